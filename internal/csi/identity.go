// The identity service: the plugin's name and version, what it can do,
// and whether it is ready.

package csi

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rnbd/rnbd/internal/version"
)

type identity struct {
	csi.UnimplementedIdentityServer
	d *Driver
}

func (s *identity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: s.d.cfg.DriverName, VendorVersion: version.Get().Version}, nil
}

func (s *identity) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	var caps []*csi.PluginCapability
	if s.d.ctrl != nil {
		svc := func(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
			return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}}}
		}
		caps = append(caps, svc(csi.PluginCapability_Service_CONTROLLER_SERVICE),
			// A volume grows while a session has it open.
			&csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{
				VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_ONLINE}}})
		// Volumes are accessible from some nodes only where the storage
		// nodes have topology labels; without, every volume is
		// accessible everywhere and the nodes report no topology.
		for _, n := range s.d.cfg.StorageNodes {
			if len(n.Labels) > 0 {
				caps = append(caps, svc(csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS))
				break
			}
		}
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

// Probe: a controller is ready once it is made: storage nodes that do
// not answer are its callers' trouble, each call's, not the driver's (a
// liveness probe that restarted it during a storage outage would turn one
// node's trouble into every volume's). A node plugin is ready when its
// rnbd-client answers: without it, it can stage nothing.
func (s *identity) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if s.d.node != nil {
		if _, err := s.d.node.client.Sessions(ctx); err != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "this node's rnbd-client does not answer: %v", err)
		}
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
