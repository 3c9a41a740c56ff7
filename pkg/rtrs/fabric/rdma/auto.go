package rdma

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/Mellanox/rdmamap"
	vnl "github.com/vishvananda/netlink"

	"github.com/rnbd/rnbd/pkg/ibverbs"
)

// DeviceFor names the RDMA device behind the network interface a path
// from src (may be zero) to dst goes out of, or "" if that interface has
// none (or this build cannot do RDMA): what --transport auto decides by.
// The interface is the one that holds dst when dst is local (rdma_cm
// loops back through it), else the one that holds src, else the route's.
// It reads sysfs and the routing table (rdmamap, netlink) and touches no
// device.
func DeviceFor(src, dst netip.Addr) (string, error) {
	if !ibverbs.Supported {
		return "", nil
	}
	ifname, err := interfaceFor(src, dst)
	if err != nil {
		return "", err
	}
	if ifname == "" {
		return "", nil
	}
	dev, err := rdmamap.GetRdmaDeviceForNetdevice(ifname)
	if err != nil {
		return "", nil // no RDMA device for it
	}
	return dev, nil
}

func interfaceFor(src, dst netip.Addr) (string, error) {
	if name := interfaceWith(dst); name != "" {
		return name, nil
	}
	if src.IsValid() {
		if name := interfaceWith(src); name != "" {
			return name, nil
		}
		return "", fmt.Errorf("rdma: no interface has source address %v", src)
	}
	routes, err := vnl.RouteGet(dst.AsSlice())
	if err != nil {
		return "", fmt.Errorf("rdma: route to %v: %w", dst, err)
	}
	if len(routes) == 0 {
		return "", errors.New("rdma: no route to " + dst.String())
	}
	link, err := vnl.LinkByIndex(routes[0].LinkIndex)
	if err != nil {
		return "", fmt.Errorf("rdma: interface of the route to %v: %w", dst, err)
	}
	return link.Attrs().Name, nil
}

// interfaceWith is the interface that holds a, or "".
func interfaceWith(a netip.Addr) string {
	ifs, err := net.Interfaces()
	if err != nil {
		return ""
	}
	for _, ifi := range ifs {
		addrs, err := ifi.Addrs()
		if err != nil {
			continue
		}
		for _, x := range addrs {
			if n, ok := x.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap() == a.Unmap() {
					return ifi.Name
				}
			}
		}
	}
	return ""
}
