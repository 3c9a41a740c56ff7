package main

import (
	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/clientd"
)

// man is what rnbd-client's man pages say beyond the commands' help.
var man = cli.Man{
	Files: `*/etc/rnbd/client.toml*
: the configuration (**rnbd-client.toml**(5)); **rnbd-client config check** checks it

*/run/rnbd/client.sock*
: the control socket (` + "`control_socket`" + `, mode 0600): the commands other than **daemon**, **config** and **version** talk to the daemon through it (**--socket**)

*/var/lib/rnbd/client.json*
: the state file (` + "`state_file`" + `): the mappings and their sessions' settings, restored at every start

*/run/rnbd*
: the NBD sockets of mappings made without **--as** (` + "`socket_dir`" + `)

*/dev/rnbd/SESSNAME/DEVICE_PATH*
: a stable name of a kernel device, a link to /dev/nbdN or /dev/ublkbN (` + "`dev_links_dir`" + `)

*/etc/rnbd/tls/*
: the certificate, key and authority the packaged configuration's ` + "`[tls]`" + ` names`,
	Signals: `**SIGTERM**, **SIGINT**
: stop and exit 0: NBD connections and sessions close, nothing is unmapped; the next start maps everything again from the state file. A kernel /dev/nbdN keeps its IO queued for dead_conn_timeout (120 s), a /dev/ublkbN holds it (ublk user recovery), until the restarted daemon takes the device back

**SIGUSR1**
: log every goroutine's stack, and go on

**SIGHUP**, **SIGPIPE**
: ignored: the configuration is read at start only; restart the daemon to apply a change (check the file first with **rnbd-client config check**)

Under systemd (Type=notify) the daemon sends READY=1 once its control socket serves and the saved mappings were tried, and STOPPING=1 when it begins to stop.`,
	DaemonExit: `**0**
: stopped by SIGTERM or SIGINT

**1**
: it could not start (a control socket another daemon has) or failed while running; the last line on standard error says why

**2**
: the configuration is wrong: an unknown key or table (named with its line and the nearest known key), a bad value, a ` + "`[tls]`" + ` table without its files; or a bad flag

**3**
: the configuration file named by **--config**, or a file it names (TLS), does not exist

**7**
: one of those files cannot be read`,
	Config: cli.ConfigPage{
		Name:  "rnbd-client.toml",
		Short: "the configuration of rnbd-client",
		Path:  clientd.DefaultConfigFile,
		Description: `**rnbd-client daemon** reads its configuration from ` + clientd.DefaultConfigFile + ` (or **--config FILE**), a TOML file; every key is optional, and a flag of **daemon** overrides the key it names. The session settings (` + "`mpath_policy`, `max_reconnect_attempts`, `reconnect_delay`, `ctrl_loss_tmo`, `no_path_timeout`, `fast_io_fail_tmo`" + `) are the defaults of every new session; **rnbd-client session set** and **map --set** change one session's.

A key or table the daemon does not know is an error naming its line and the nearest known key, and the daemon does not start. A file of a newer ` + "`version`" + ` than the daemon understands is refused. A ` + "`[tls]`" + ` table makes TLS required: the daemon does not speak plain TCP to servers when it has one. **rnbd-client config check [FILE]** checks a file as the daemon reads it, starting nothing (exit 0 ok, 2 wrong, 3 missing).

Durations are written "5s", "2m0s", and the timeouts that can be off as "off".`,
		Keys: clientd.ConfigKeys,
		Example: `version = 1
mpath_policy = "min-inflight"
no_path_timeout = "2m0s"
metrics_listen = "127.0.0.1:9725"

[tls]
cert = "/etc/rnbd/tls/client.crt"
key = "/etc/rnbd/tls/client.key"
ca = "/etc/rnbd/tls/ca.crt"`,
		SeeAlso: []string{"rnbd-client(8)", "rnbd-client-daemon(8)", "rnbd-client-config-check(8)", "rnbd-server.toml(5)"},
	},
}
