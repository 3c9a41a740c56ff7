package clientd

import "github.com/rnbd/rnbd/internal/conf"

// ConfigKeys is the reference of /etc/rnbd/client.toml: docs/client.md's
// table and rnbd-client.toml(5) are made from it (TestConfigKeysDoc
// holds it to Config, the daemon's flags and the docs). The session
// settings are the defaults of every new session; `rnbd-client session
// set` and `map --set` change one session's.
var ConfigKeys = []conf.KeyDoc{
	{Keys: []string{"version"}, Default: "1",
		Doc: "the file's format; a file of a newer version than the daemon understands is refused"},
	{Keys: []string{"control_socket"}, Flag: "`--control-socket`", Default: "`/run/rnbd/client.sock`",
		Doc: "the control API (mode 0600)"},
	{Keys: []string{"state_file"}, Flag: "`--state-file`", Default: "`/var/lib/rnbd/client.json`",
		Doc: "the mappings and their sessions' settings, restored at start"},
	{Keys: []string{"socket_dir"}, Flag: "`--socket-dir`", Default: "`/run/rnbd`",
		Doc: "where the NBD sockets of mappings made without `--as` go"},
	{Keys: []string{"conns_per_path"}, Flag: "`--conns-per-path`", Default: "the number of CPUs",
		Doc: "IO connections per path"},
	{Keys: []string{"mpath_policy"}, Flag: "`--mpath-policy`", Default: "min-inflight",
		Doc: "how a session spreads IO over its paths: `round-robin`, `min-inflight` or `min-latency` (a session setting)"},
	{Keys: []string{"max_reconnect_attempts"}, Flag: "`--max-reconnect-attempts`", Default: "-1",
		Doc: "reconnect attempts of a failed path: -1 forever, 0 never, or N (a session setting)"},
	{Keys: []string{"reconnect_delay"}, Flag: "`--reconnect-delay`", Default: "1s",
		Doc: "the wait before a failed path's first reconnect attempt, doubled after each failed one up to 30 s (or itself, if longer), plus up to 1 s of jitter; 100ms to 1h (a session setting)"},
	{Keys: []string{"ctrl_loss_tmo"}, Flag: "`--ctrl-loss-tmo`", Default: "off",
		Doc: "NVMe-oF's ctrl_loss_tmo: a path down this long stops reconnecting (until `path reconnect`), whatever `max_reconnect_attempts` leaves; a duration or `off` (a session setting)"},
	{Keys: []string{"no_path_timeout"}, Flag: "`--no-path-timeout`", Default: "2m0s",
		Doc: "how long IO waits when no path is connected; 0 fails it at once (a session setting)"},
	{Keys: []string{"fast_io_fail_tmo"}, Flag: "`--fast-io-fail-tmo`", Default: "off",
		Doc: "NVMe-oF's fast_io_fail_tmo: this long after a session lost its last path, IO waiting for one fails, and new IO fails at once (instead of waiting `no_path_timeout` from its own arrival); a duration or `off` (a session setting)"},
	{Keys: []string{"hb_interval", "hb_missed_max"}, Flag: "`--hb-interval`, `--hb-missed-max`", Default: "5s, 5",
		Doc: "heartbeat; a path is dead after `hb_missed_max` missed heartbeats"},
	{Keys: []string{"tcp_user_timeout"}, Flag: "`--tcp-user-timeout`", Default: "1s",
		Doc: "how long data sent on a tcp:// path may stay unacknowledged before the connection is killed and its IO fails over to another path (TCP_USER_TIMEOUT); `off`: the kernel's limits, minutes. Raise it where round trips are long or loss is heavy ([operations.md](operations.md#timers))"},
	{Keys: []string{"nbd_io_timeout"}, Flag: "`--nbd-io-timeout`", Default: "0s (derived)",
		Doc: "the kernel nbd driver's request timeout for `/dev/nbdN` mappings; 0 derives it: `no_path_timeout` + `hb_interval` × (`hb_missed_max` + 1) + 10s, at least 30s, so the kernel never re-sends a request the daemon may still send to the server"},
	{Keys: []string{"size_poll"}, Flag: "`--size-poll`", Default: "5s",
		Doc: "how often each session asks its servers for its devices' sizes, which then reach `/dev/nbdN`, `/dev/ublkbN` and new NBD connections; 0 never (`remap` still does)"},
	{Keys: []string{"mirror_leg_timeout"}, Flag: "`--mirror-leg-timeout`", Default: "5s",
		Doc: "how long a mirror's leg (or witness) may hold requests without completing any before it is fenced — its session closed — and taken out, IO going on with the other legs ([replication.md](replication.md)); at least 100ms"},
	{Keys: []string{"ublk_queue_depth"}, Flag: "`--ublk-queue-depth`", Default: "64",
		Doc: "requests in flight per ublk queue (one queue per CPU); each takes a buffer of `ublk_max_io_kb`, registered with the session; 1 to 4096"},
	{Keys: []string{"ublk_max_io_kb"}, Flag: "`--ublk-max-io-kb`", Default: "512",
		Doc: "the largest request a ublk device takes (its max_sectors_kb), a multiple of 4 from 4 to 1024: the block layer splits larger IO"},
	{Keys: []string{"nbd_buffers"}, Flag: "`--nbd-buffers`", Default: "64",
		Doc: "NBD requests of up to 1 MiB in flight per device served over NBD (a socket or `/dev/nbdN`); each takes 1 MiB of memory registered with the session; 1 to 4096"},
	{Keys: []string{"dev_links_dir"}, Flag: "`--dev-links-dir`", Default: "`/dev/rnbd`",
		Doc: "where kernel devices (`--as nbd`, `--as ublk`) get stable names, `DIR/SESSNAME/DEVICE_PATH`, a link to `/dev/nbdN` or `/dev/ublkbN` that follows the mapping across restarts ([operations.md](operations.md#boot-and-fstab)); empty: none"},
	{Keys: []string{"metrics_listen"}, Flag: "`--metrics-listen`", Default: "none",
		Doc: "`HOST:PORT` to serve Prometheus metrics on at `/metrics` ([metrics.md](metrics.md)); loopback or a management network"},
	{Keys: []string{"log_level", "log_format"}, Flag: "`--log-level`, `--log-format`", Default: "info, text",
		Doc: "`error`…`debug`; `text` or `json`"},
	{Table: "[tls]", Keys: []string{"cert", "key", "ca"}, Flag: "`--tls-cert`, `--tls-key`, `--tls-ca`", Default: "unset",
		Doc: "TLS 1.3 to every server over TCP, presenting `cert` (its names are the client's identity on servers) and accepting only a server certificate of `ca` ([operations.md](operations.md#tls-on-the-tcp-fabric)); RDMA paths do not use it. With a `[tls]` table the daemon runs with TLS or not at all: the table without the three, or one of them emptied by a flag, or files that do not load, stop it"},
	{Table: "[tls]", Keys: []string{"server_name"}, Flag: "`--tls-server-name`", Default: "the address dialed",
		Doc: "the name a server's certificate must have (a DNS alternative name); unset, the certificate must name the address dialed (an IP alternative name)"},
}
