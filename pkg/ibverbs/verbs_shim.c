//go:build cgo && linux

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include "verbs_shim.h"

/* Errors come back as -errno, so Go needs no errno lookup. */

int rnbd_post_send(struct ibv_qp *qp, const struct rnbd_send_wr *w, int n, int *bad)
{
	struct ibv_send_wr wr[RNBD_MAX_CHAIN], *bad_wr = NULL;
	struct ibv_sge sge[RNBD_MAX_CHAIN * RNBD_MAX_SGE];
	int i, j, ret;

	if (n < 1 || n > RNBD_MAX_CHAIN)
		return -EINVAL;
	memset(wr, 0, sizeof(wr[0]) * n);
	for (i = 0; i < n; i++) {
		if (w[i].num_sge > RNBD_MAX_SGE)
			return -EINVAL;
		for (j = 0; j < (int)w[i].num_sge; j++) {
			sge[i * RNBD_MAX_SGE + j].addr = w[i].sg[j].addr;
			sge[i * RNBD_MAX_SGE + j].length = w[i].sg[j].length;
			sge[i * RNBD_MAX_SGE + j].lkey = w[i].sg[j].lkey;
		}
		wr[i].wr_id = w[i].wr_id;
		wr[i].opcode = w[i].opcode;
		wr[i].send_flags = w[i].send_flags;
		wr[i].num_sge = w[i].num_sge;
		wr[i].sg_list = w[i].num_sge ? &sge[i * RNBD_MAX_SGE] : NULL;
		switch (w[i].opcode) {
		case IBV_WR_SEND_WITH_INV:
		case IBV_WR_LOCAL_INV:
			wr[i].invalidate_rkey = w[i].invalidate_rkey;
			break;
		default:
			wr[i].imm_data = htonl(w[i].imm);
		}
		wr[i].wr.rdma.remote_addr = w[i].remote_addr;
		wr[i].wr.rdma.rkey = w[i].rkey;
		wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
	}
	ret = ibv_post_send(qp, wr, &bad_wr);
	if (ret) {
		if (bad)
			*bad = bad_wr ? (int)(bad_wr - wr) : 0;
		return -ret;
	}
	return 0;
}

int rnbd_post_recv(struct ibv_qp *qp, const struct rnbd_recv_wr *w, int n, int *bad)
{
	struct ibv_recv_wr wr[RNBD_MAX_CHAIN], *bad_wr = NULL;
	struct ibv_sge sge[RNBD_MAX_CHAIN];
	int i, ret;

	if (n < 1 || n > RNBD_MAX_CHAIN)
		return -EINVAL;
	memset(wr, 0, sizeof(wr[0]) * n);
	for (i = 0; i < n; i++) {
		sge[i].addr = w[i].sg.addr;
		sge[i].length = w[i].sg.length;
		sge[i].lkey = w[i].sg.lkey;
		wr[i].wr_id = w[i].wr_id;
		wr[i].num_sge = w[i].num_sge ? 1 : 0;
		wr[i].sg_list = w[i].num_sge ? &sge[i] : NULL;
		wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
	}
	ret = ibv_post_recv(qp, wr, &bad_wr);
	if (ret) {
		if (bad)
			*bad = bad_wr ? (int)(bad_wr - wr) : 0;
		return -ret;
	}
	return 0;
}

int rnbd_poll_cq(struct ibv_cq *cq, struct rnbd_wc *out, int n)
{
	struct ibv_wc wc[RNBD_MAX_POLL];
	int i, got;

	if (n > RNBD_MAX_POLL)
		n = RNBD_MAX_POLL;
	got = ibv_poll_cq(cq, n, wc);
	if (got < 0)
		return -EIO;
	for (i = 0; i < got; i++) {
		out[i].wr_id = wc[i].wr_id;
		out[i].status = wc[i].status;
		out[i].opcode = wc[i].opcode;
		out[i].byte_len = wc[i].byte_len;
		out[i].wc_flags = wc[i].wc_flags;
		out[i].imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? ntohl(wc[i].imm_data) : 0;
		out[i].inv_rkey = (wc[i].wc_flags & IBV_WC_WITH_INV) ? wc[i].invalidated_rkey : 0;
		out[i].qp_num = wc[i].qp_num;
		out[i].vendor_err = wc[i].vendor_err;
	}
	return got;
}

int rnbd_req_notify(struct ibv_cq *cq)
{
	return -ibv_req_notify_cq(cq, 0);
}

/* The channel's fd is non-blocking: -EAGAIN when there is no event. */
int rnbd_get_cq_event(struct ibv_comp_channel *ch, struct ibv_cq **cq)
{
	void *ctx;

	if (ibv_get_cq_event(ch, cq, &ctx))
		return -errno;
	ibv_ack_cq_events(*cq, 1);
	return 0;
}

/* Copies the event and acknowledges it at once: nothing refers to the
 * librdmacm event afterwards, so destroying an id never waits for us. */
int rnbd_get_cm_event(struct rdma_event_channel *ch, struct rnbd_cm_event *out)
{
	struct rdma_cm_event *ev;
	int n = 0;

	if (rdma_get_cm_event(ch, &ev))
		return -errno;
	out->event = ev->event;
	out->status = ev->status;
	out->id = ev->id;
	out->listen_id = ev->listen_id;
	if (ev->id && ev->id->ps != RDMA_PS_UDP && ev->param.conn.private_data) {
		n = ev->param.conn.private_data_len;
		if (n > RNBD_MAX_PRIV)
			n = RNBD_MAX_PRIV;
		memcpy(out->private_data, ev->param.conn.private_data, n);
	}
	out->private_data_len = n;
	rdma_ack_cm_event(ev);
	return 0;
}

int rnbd_set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);

	if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
		return -errno;
	return 0;
}

static socklen_t to_sockaddr(const struct rnbd_addr *a, struct sockaddr_storage *ss)
{
	memset(ss, 0, sizeof(*ss));
	if (a->family == AF_INET) {
		struct sockaddr_in *s = (struct sockaddr_in *)ss;

		s->sin_family = AF_INET;
		s->sin_port = htons(a->port);
		memcpy(&s->sin_addr, a->ip, 4);
		return sizeof(*s);
	}
	if (a->family == AF_INET6) {
		struct sockaddr_in6 *s = (struct sockaddr_in6 *)ss;

		s->sin6_family = AF_INET6;
		s->sin6_port = htons(a->port);
		s->sin6_scope_id = a->scope_id;
		memcpy(&s->sin6_addr, a->ip, 16);
		return sizeof(*s);
	}
	return 0;
}

static void from_sockaddr(const struct sockaddr *sa, struct rnbd_addr *a)
{
	memset(a, 0, sizeof(*a));
	if (!sa)
		return;
	if (sa->sa_family == AF_INET) {
		const struct sockaddr_in *s = (const struct sockaddr_in *)sa;

		a->family = AF_INET;
		a->port = ntohs(s->sin_port);
		memcpy(a->ip, &s->sin_addr, 4);
	} else if (sa->sa_family == AF_INET6) {
		const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)sa;

		a->family = AF_INET6;
		a->port = ntohs(s->sin6_port);
		a->scope_id = s->sin6_scope_id;
		memcpy(a->ip, &s->sin6_addr, 16);
	}
}

int rnbd_resolve_addr(struct rdma_cm_id *id, const struct rnbd_addr *src, const struct rnbd_addr *dst, int timeout_ms)
{
	struct sockaddr_storage s, d;

	if (!to_sockaddr(dst, &d))
		return -EAFNOSUPPORT;
	if (src->family && !to_sockaddr(src, &s))
		return -EAFNOSUPPORT;
	if (rdma_resolve_addr(id, src->family ? (struct sockaddr *)&s : NULL, (struct sockaddr *)&d, timeout_ms))
		return -errno;
	return 0;
}

int rnbd_bind_addr(struct rdma_cm_id *id, const struct rnbd_addr *a)
{
	struct sockaddr_storage s;

	if (!to_sockaddr(a, &s))
		return -EAFNOSUPPORT;
	if (rdma_bind_addr(id, (struct sockaddr *)&s))
		return -errno;
	return 0;
}

int rnbd_local_addr(struct rdma_cm_id *id, struct rnbd_addr *a)
{
	from_sockaddr(rdma_get_local_addr(id), a);
	return 0;
}

int rnbd_peer_addr(struct rdma_cm_id *id, struct rnbd_addr *a)
{
	from_sockaddr(rdma_get_peer_addr(id), a);
	return 0;
}

static void to_conn_param(const struct rnbd_conn_param *p, struct rdma_conn_param *cp)
{
	memset(cp, 0, sizeof(*cp));
	cp->private_data = p->private_data_len ? p->private_data : NULL;
	cp->private_data_len = p->private_data_len;
	cp->responder_resources = p->responder_resources;
	cp->initiator_depth = p->initiator_depth;
	cp->retry_count = p->retry_count;
	cp->rnr_retry_count = p->rnr_retry_count;
}

int rnbd_connect(struct rdma_cm_id *id, const struct rnbd_conn_param *p)
{
	struct rdma_conn_param cp;

	to_conn_param(p, &cp);
	if (rdma_connect(id, &cp))
		return -errno;
	return 0;
}

int rnbd_accept(struct rdma_cm_id *id, const struct rnbd_conn_param *p)
{
	struct rdma_conn_param cp;

	to_conn_param(p, &cp);
	if (rdma_accept(id, &cp))
		return -errno;
	return 0;
}

int rnbd_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *cq,
		   uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t max_inline)
{
	struct ibv_qp_init_attr a;

	memset(&a, 0, sizeof(a));
	a.send_cq = cq;
	a.recv_cq = cq;
	a.qp_type = IBV_QPT_RC;
	a.sq_sig_all = 0;
	a.cap.max_send_wr = max_send_wr;
	a.cap.max_recv_wr = max_recv_wr;
	a.cap.max_send_sge = RNBD_MAX_SGE;
	a.cap.max_recv_sge = 1;
	a.cap.max_inline_data = max_inline;
	if (rdma_create_qp(id, pd, &a))
		return -errno;
	return 0;
}

int rnbd_bind_mw(struct ibv_qp *qp, struct ibv_mw *mw, struct ibv_mr *mr,
		 uint64_t addr, uint64_t len, uint32_t access, uint64_t wr_id, int signaled)
{
	struct ibv_mw_bind b;

	memset(&b, 0, sizeof(b));
	b.wr_id = wr_id;
	b.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
	b.bind_info.mr = mr;
	b.bind_info.addr = addr;
	b.bind_info.length = len;
	b.bind_info.mw_access_flags = access;
	return -ibv_bind_mw(qp, mw, &b);
}

struct ibv_context *rnbd_id_verbs(struct rdma_cm_id *id) { return id->verbs; }
struct ibv_qp *rnbd_id_qp(struct rdma_cm_id *id) { return id->qp; }
int rnbd_id_port(struct rdma_cm_id *id) { return id->port_num; }
const char *rnbd_device_name(struct ibv_context *ctx) { return ibv_get_device_name(ctx->device); }
int rnbd_qp_num(struct ibv_qp *qp) { return qp->qp_num; }

int rnbd_query_device(struct ibv_context *ctx, uint64_t *cap_flags, int *max_qp_wr, int *max_cqe, int *max_mw)
{
	struct ibv_device_attr a;
	int ret = ibv_query_device(ctx, &a);

	if (ret)
		return -ret;
	*cap_flags = a.device_cap_flags;
	*max_qp_wr = a.max_qp_wr;
	*max_cqe = a.max_cqe;
	*max_mw = a.max_mw;
	return 0;
}
