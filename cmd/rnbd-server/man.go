package main

import (
	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/serverd"
)

// man is what rnbd-server's man pages say beyond the commands' help.
var man = cli.Man{
	Files: `*/etc/rnbd/server.toml*
: the configuration (**rnbd-server.toml**(5)); **rnbd-server config check** checks it

*/run/rnbd/server.sock*
: the control socket (` + "`control_socket`" + `, mode 0600): the commands other than **daemon**, **config** and **version** talk to the daemon through it (**--socket**)

*/var/lib/rnbd/server.json*
: the state file (` + "`state_file`" + `): the exports made by **map**, kept across restarts, and the session names bound to client identities

*/etc/rnbd/tls/*
: the certificate, key and authority the packaged configuration's ` + "`[tls]`" + ` names

*/srv/rnbd*
: the directory the packaged unit lets the daemon write; exports elsewhere need a drop-in with ReadWritePaths= (**systemctl edit rnbd-server**)`,
	Signals: `**SIGTERM**, **SIGINT**
: drain and exit 0: no new paths, every request already received answered, every device closed

**SIGUSR1**
: log every goroutine's stack, and go on

**SIGHUP**, **SIGPIPE**
: ignored: the configuration is read at start only; restart the daemon to apply a change (check the file first with **rnbd-server config check**)

Under systemd (Type=notify) the daemon sends READY=1 once it listens and serves its exports, and STOPPING=1 when it begins to stop.`,
	DaemonExit: `**0**
: stopped by SIGTERM or SIGINT, after draining

**1**
: it could not start (an address it cannot listen on, a control socket another daemon has) or failed while running; the last line on standard error says why

**2**
: the configuration is wrong: an unknown key or table (named with its line and the nearest known key), a bad value, a ` + "`[tls]`" + ` table without its files; or a bad flag

**3**
: the configuration file named by **--config**, or a file it names (TLS), does not exist

**7**
: one of those files cannot be read`,
	Config: cli.ConfigPage{
		Name:  "rnbd-server.toml",
		Short: "the configuration of rnbd-server",
		Path:  serverd.DefaultConfigFile,
		Description: `**rnbd-server daemon** reads its configuration from ` + serverd.DefaultConfigFile + ` (or **--config FILE**), a TOML file; every key is optional, and a flag of **daemon** overrides the key it names. The packaged file is the defaults, annotated, but for ` + "`listen`" + ` and ` + "`[tls]`" + `, which the operator sets before starting the daemon.

A key or table the daemon does not know is an error naming its line and the nearest known key ("did you mean listen?"), and the daemon does not start: a misspelt key would otherwise leave its setting at the default (a server listening on every interface, or without TLS). A file of a newer ` + "`version`" + ` than the daemon understands is refused. A ` + "`[tls]`" + ` table makes TLS required: the daemon runs with TLS on its tcp:// addresses or not at all. **rnbd-server config check [FILE]** checks a file as the daemon reads it, starting nothing (exit 0 ok, 2 wrong, 3 missing).

Durations are written "5s", "2m0s"; sizes as a number of bytes or a string with a unit ("8GiB").`,
		Keys: serverd.ConfigKeys,
		Example: `version = 1
listen = ["tcp://10.10.0.5:1234", "rdma://10.10.0.5:1234"]
metrics_listen = "127.0.0.1:9724"

[tls]
cert = "/etc/rnbd/tls/server.crt"
key = "/etc/rnbd/tls/server.key"
ca = "/etc/rnbd/tls/ca.crt"

[[export]]
name = "vol1"
path = "/dev/vg0/vol1"
allow_identities = ["host7=rw", "backup=ro"]`,
		SeeAlso: []string{"rnbd-server(8)", "rnbd-server-daemon(8)", "rnbd-server-config-check(8)", "rnbd-client.toml(5)"},
	},
}
