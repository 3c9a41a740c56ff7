// Command gonbd runs github.com/pojntfx/go-nbd, an NBD server and client
// we did not write, against ours:
//
//	gonbd serve -file IMG -listen unix:PATH|tcp:ADDR [-name NAME]
//	gonbd attach -connect unix:PATH|tcp:ADDR -export NAME -device /dev/nbdN
//
// serve is go-nbd's server (pkg/server) with its file backend: a peer of
// make bench-peers (tools/benchpeers). It serves one request at a time per
// connection, READ and WRITE only.
//
// attach is go-nbd's client (pkg/client): it negotiates with an NBD server
// (rnbd-client's NBD socket, in the VM tier) and attaches /dev/nbdN to
// the connection through the kernel's ioctls (NBD_SET_SOCK, NBD_DO_IT);
// the kernel then serves the device over it until SIGINT or SIGTERM,
// which disconnects (NBD_DISCONNECT) and exits 0. One connection only:
// after a second NBD_SET_SOCK go-nbd's NBD_DO_IT fails with EINVAL.
//
// go-nbd v0.3.2's client sends NBD_OPT_GO with its length field 0 and the
// option's data after it, which a server that goes by the length (ours;
// the protocol says so) answers with NBD_REP_ERR_INVALID. So attach hands
// go-nbd one end of a socketpair and relays it to the server, writing that
// one field right; every other byte, the kernel's requests and the
// server's replies, passes as it is.
//
// NBD_DO_IT sleeps interruptibly until the device is disconnected. A
// SIGINT that the kernel hands to the thread sleeping in it ends the
// ioctl before our NBD_DISCONNECT (the kernel shuts the device down),
// and the ioctl, restarted, fails: attach would exit 1 although the
// device is gone. The kernel gives a signal sent to a process to its
// main thread, unless that thread blocks signals at that moment (the Go
// runtime does while it clones a thread) or has one pending; then to
// any other thread that takes it, NBD_DO_IT's too. So main keeps the
// main thread to itself (init locks it there) and waits: that thread
// makes no thread and no system call of go-nbd's, and takes the signal.
package main

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"

	"github.com/pojntfx/go-nbd/pkg/backend"
	"github.com/pojntfx/go-nbd/pkg/client"
	"github.com/pojntfx/go-nbd/pkg/protocol"
	"github.com/pojntfx/go-nbd/pkg/server"
)

// init keeps the main goroutine on the main thread, and so every other
// goroutine off it: a SIGINT or SIGTERM reaches a thread that is not in
// NBD_DO_IT.
func init() { runtime.LockOSThread() }

func main() {
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	log.SetPrefix("gonbd: ")
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "attach":
		err = attach(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		log.Fatal(err)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: gonbd serve -file IMG -listen unix:PATH|tcp:ADDR [-name NAME]\n"+
		"       gonbd attach -connect unix:PATH|tcp:ADDR -export NAME -device /dev/nbdN")
	os.Exit(2)
}

// endpoint splits "unix:PATH" or "tcp:ADDR".
func endpoint(s string) (network, addr string, err error) {
	network, addr, ok := strings.Cut(s, ":")
	if !ok || addr == "" || network != "unix" && network != "tcp" {
		return "", "", fmt.Errorf("%q: want unix:PATH or tcp:ADDR", s)
	}
	return network, addr, nil
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	file := fs.String("file", "", "the file to serve")
	listen := fs.String("listen", "", "unix:PATH or tcp:ADDR")
	name := fs.String("name", "bench", "the export's name")
	fs.Parse(args)
	network, addr, err := endpoint(*listen)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(*file, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	l, err := net.Listen(network, addr)
	if err != nil {
		return err
	}
	defer l.Close()
	go func() {
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
		<-sig
		l.Close()
	}()
	exports := []*server.Export{{Name: *name, Description: "go-nbd file backend", Backend: backend.NewFileBackend(f)}}
	// Zero block sizes are go-nbd's defaults (1, 4096, 32 MiB).
	opts := &server.Options{SupportsMultiConn: true}
	log.Printf("serving %s as %q on %s", *file, *name, *listen)
	for {
		nc, err := l.Accept()
		if errors.Is(err, net.ErrClosed) {
			return nil
		} else if err != nil {
			return err
		}
		go func() {
			defer nc.Close()
			if err := server.Handle(nc, exports, opts); err != nil && !errors.Is(err, io.EOF) {
				log.Printf("connection: %v", err)
			}
		}()
	}
}

func attach(args []string) error {
	fs := flag.NewFlagSet("attach", flag.ExitOnError)
	connect := fs.String("connect", "", "the NBD server: unix:PATH or tcp:ADDR")
	export := fs.String("export", "", "the export's name")
	device := fs.String("device", "", "the kernel device, /dev/nbdN")
	timeout := fs.Int("timeout", 60, "the kernel's request timeout, seconds")
	fs.Parse(args)
	network, addr, err := endpoint(*connect)
	if err != nil {
		return err
	}
	srv, err := net.Dial(network, addr)
	if err != nil {
		return err
	}
	defer srv.Close()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	kern, err := fileConn(fds[0], "nbd-kernel")
	if err != nil {
		return err
	}
	defer kern.Close()
	relay, err := fileConn(fds[1], "nbd-relay")
	if err != nil {
		return err
	}
	defer relay.Close()
	go func() {
		io.Copy(relay, srv)
		relay.Close()
	}()
	go func() {
		if err := fixGo(relay, srv); err != nil {
			log.Printf("relay: %v", err)
		}
		io.Copy(srv, relay)
		srv.Close()
	}()

	dev, err := os.Open(*device)
	if err != nil {
		return err
	}
	defer dev.Close()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sig
		log.Printf("disconnecting %s", *device)
		if err := client.Disconnect(dev); err != nil {
			log.Printf("disconnect: %v", err)
		}
	}()
	err = client.Connect(kern, dev, &client.Options{
		ExportName:  *export,
		Timeout:     *timeout,
		OnConnected: func() { log.Printf("attached %s to %s export %q", *device, *connect, *export) },
	})
	if err != nil {
		return fmt.Errorf("go-nbd's client: %w", err)
	}
	log.Printf("%s disconnected", *device)
	return nil
}

// fileConn makes a net.Conn of a socket descriptor (go-nbd's client takes
// a *net.UnixConn or *net.TCPConn for NBD_SET_SOCK).
func fileConn(fd int, name string) (*net.UnixConn, error) {
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	return c.(*net.UnixConn), nil
}

// fixGo passes the client's side of the negotiation from c to srv: the
// client flags and each option, up to NBD_OPT_GO, after which the
// transmission begins. An NBD_OPT_GO or NBD_OPT_INFO whose length says 0
// is go-nbd's: its data (the name's length and the name, the number of
// information requests and the requests) follows anyway, and is sent
// with its length.
func fixGo(c io.Reader, srv io.Writer) error {
	var flags [4]byte
	if _, err := io.ReadFull(c, flags[:]); err != nil {
		return err
	}
	if _, err := srv.Write(flags[:]); err != nil {
		return err
	}
	for {
		var h protocol.NegotiationOptionHeader
		if err := binary.Read(c, binary.BigEndian, &h); err != nil {
			return err
		}
		var data []byte
		if (h.ID == protocol.NEGOTIATION_ID_OPTION_GO || h.ID == protocol.NEGOTIATION_ID_OPTION_INFO) && h.Length == 0 {
			var n uint32
			if err := binary.Read(c, binary.BigEndian, &n); err != nil {
				return err
			}
			if n > 4096 {
				return fmt.Errorf("an export name of %d bytes", n)
			}
			data = binary.BigEndian.AppendUint32(data, n)
			name := make([]byte, n+2)
			if _, err := io.ReadFull(c, name); err != nil {
				return err
			}
			data = append(data, name...)
			nreq := binary.BigEndian.Uint16(name[n:])
			reqs := make([]byte, 2*int(nreq))
			if _, err := io.ReadFull(c, reqs); err != nil {
				return err
			}
			data = append(data, reqs...)
			h.Length = uint32(len(data))
			log.Printf("go-nbd's option %d said length 0: sent with its %d bytes", h.ID, h.Length)
		} else {
			data = make([]byte, h.Length)
			if _, err := io.ReadFull(c, data); err != nil {
				return err
			}
		}
		b, _ := binary.Append(nil, binary.BigEndian, h)
		if _, err := srv.Write(append(b, data...)); err != nil {
			return err
		}
		if h.ID == protocol.NEGOTIATION_ID_OPTION_GO {
			return nil
		}
	}
}
