module github.com/rnbd/rnbd

go 1.26

require (
	github.com/BurntSushi/toml v1.6.0
	github.com/sirupsen/logrus v1.10.2
	github.com/spf13/cobra v1.10.2
	go.uber.org/goleak v1.3.0
	golang.org/x/sys v0.47.0
)

require (
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/spf13/pflag v1.0.9 // indirect
)
