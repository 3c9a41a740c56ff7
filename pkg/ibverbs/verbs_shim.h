/*
 * The C half of package ibverbs: flat structs Go can fill and read (no
 * unions, no pointers into Go memory) and the few calls that batch work
 * across the cgo boundary: a chain of send or receive work requests per
 * call, many completions per poll, one CM event copied and acknowledged.
 */
#ifndef RNBD_VERBS_SHIM_H
#define RNBD_VERBS_SHIM_H

#include <stdint.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

/* The most work requests one post call takes, and completions one poll
 * returns. */
#define RNBD_MAX_CHAIN 16
#define RNBD_MAX_POLL 64
#define RNBD_MAX_SGE 2
#define RNBD_MAX_PRIV 256

struct rnbd_sge {
	uint64_t addr;
	uint32_t length;
	uint32_t lkey;
};

struct rnbd_send_wr {
	uint64_t wr_id;
	uint64_t remote_addr;
	uint32_t opcode;     /* enum ibv_wr_opcode */
	uint32_t send_flags; /* enum ibv_send_flags */
	uint32_t rkey;
	uint32_t imm;        /* host byte order; sent big-endian */
	uint32_t invalidate_rkey;
	uint32_t num_sge;
	struct rnbd_sge sg[RNBD_MAX_SGE];
};

struct rnbd_recv_wr {
	uint64_t wr_id;
	uint32_t num_sge;
	uint32_t pad;
	struct rnbd_sge sg;
};

struct rnbd_wc {
	uint64_t wr_id;
	uint32_t status;  /* enum ibv_wc_status */
	uint32_t opcode;  /* enum ibv_wc_opcode */
	uint32_t byte_len;
	uint32_t imm;     /* host byte order, if IBV_WC_WITH_IMM */
	uint32_t inv_rkey; /* if IBV_WC_WITH_INV */
	uint32_t wc_flags;
	uint32_t qp_num;
	uint32_t vendor_err;
};

struct rnbd_addr {
	int family; /* AF_INET, AF_INET6, 0: none */
	uint8_t ip[16];
	uint16_t port;
	uint32_t scope_id;
};

struct rnbd_cm_event {
	int event;
	int status;
	struct rdma_cm_id *id;
	struct rdma_cm_id *listen_id;
	uint8_t private_data[RNBD_MAX_PRIV];
	int private_data_len;
};

struct rnbd_conn_param {
	uint8_t private_data[RNBD_MAX_PRIV];
	uint8_t private_data_len;
	uint8_t responder_resources;
	uint8_t initiator_depth;
	uint8_t retry_count;
	uint8_t rnr_retry_count;
};

/* bad (may be NULL) gets the index of the first request not posted. */
int rnbd_post_send(struct ibv_qp *qp, const struct rnbd_send_wr *w, int n, int *bad);
int rnbd_post_recv(struct ibv_qp *qp, const struct rnbd_recv_wr *w, int n, int *bad);
int rnbd_poll_cq(struct ibv_cq *cq, struct rnbd_wc *out, int n);
int rnbd_req_notify(struct ibv_cq *cq);
int rnbd_get_cq_event(struct ibv_comp_channel *ch, struct ibv_cq **cq);
int rnbd_get_cm_event(struct rdma_event_channel *ch, struct rnbd_cm_event *out);
int rnbd_set_nonblock(int fd);
int rnbd_resolve_addr(struct rdma_cm_id *id, const struct rnbd_addr *src, const struct rnbd_addr *dst, int timeout_ms);
int rnbd_bind_addr(struct rdma_cm_id *id, const struct rnbd_addr *a);
int rnbd_local_addr(struct rdma_cm_id *id, struct rnbd_addr *a);
int rnbd_peer_addr(struct rdma_cm_id *id, struct rnbd_addr *a);
int rnbd_connect(struct rdma_cm_id *id, const struct rnbd_conn_param *p);
int rnbd_accept(struct rdma_cm_id *id, const struct rnbd_conn_param *p);
int rnbd_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *cq,
		   uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t max_inline);
int rnbd_bind_mw(struct ibv_qp *qp, struct ibv_mw *mw, struct ibv_mr *mr,
		 uint64_t addr, uint64_t len, uint32_t access, uint64_t wr_id, int signaled);
struct ibv_context *rnbd_id_verbs(struct rdma_cm_id *id);
struct ibv_qp *rnbd_id_qp(struct rdma_cm_id *id);
int rnbd_id_port(struct rdma_cm_id *id);
const char *rnbd_device_name(struct ibv_context *ctx);
int rnbd_query_device(struct ibv_context *ctx, uint64_t *cap_flags, int *max_qp_wr, int *max_cqe, int *max_mw);
int rnbd_qp_num(struct ibv_qp *qp);

#endif
