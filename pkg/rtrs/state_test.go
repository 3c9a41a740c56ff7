package rtrs

import (
	"testing"
)

// TestPathStateTable checks all 7x7 transitions against the table of
// rtrs_clt_change_state, written out here independently of state.go.
func TestPathStateTable(t *testing.T) {
	states := []CltPathState{CltPathConnecting, CltPathConnectingErr, CltPathReconnecting, CltPathConnected, CltPathClosing, CltPathClosed, CltPathDead}
	allowed := map[[2]CltPathState]bool{
		{CltPathReconnecting, CltPathConnecting}: true,

		{CltPathConnected, CltPathReconnecting}:     true,
		{CltPathConnectingErr, CltPathReconnecting}: true,
		{CltPathClosed, CltPathReconnecting}:        true,

		{CltPathConnecting, CltPathConnected}: true,

		{CltPathConnecting, CltPathConnectingErr}: true,

		{CltPathConnecting, CltPathClosing}:    true,
		{CltPathConnectingErr, CltPathClosing}: true,
		{CltPathReconnecting, CltPathClosing}:  true,
		{CltPathConnected, CltPathClosing}:     true,

		{CltPathClosing, CltPathClosed}: true,

		{CltPathClosed, CltPathDead}: true,
	}
	n := 0
	for _, from := range states {
		for _, to := range states {
			want := allowed[[2]CltPathState{from, to}]
			p := &CltPath{stateCh: make(chan struct{})}
			p.state.Store(int32(from))
			ch := p.stateCh
			p.mu.Lock()
			got := p.changeStateLocked(to)
			p.mu.Unlock()
			if got != want {
				t.Errorf("%v -> %v: changed=%v, want %v", from, to, got, want)
			}
			if got {
				n++
				if p.State() != to {
					t.Errorf("%v -> %v: state is %v", from, to, p.State())
				}
				select {
				case <-ch:
				default:
					t.Errorf("%v -> %v: waiters not woken", from, to)
				}
			} else if p.State() != from {
				t.Errorf("%v -> %v refused but state is %v", from, to, p.State())
			}
		}
	}
	if n != len(allowed) {
		t.Fatalf("%d transitions allowed, want %d", n, len(allowed))
	}
}

func TestPathStateFromTo(t *testing.T) {
	p := &CltPath{stateCh: make(chan struct{})}
	p.state.Store(int32(CltPathConnected))
	if p.changeStateFromTo(CltPathConnecting, CltPathConnectingErr) {
		t.Fatal("from-to changed a path that was not in the from state")
	}
	if !p.changeStateFromTo(CltPathConnected, CltPathReconnecting) || p.State() != CltPathReconnecting {
		t.Fatal("CONNECTED -> RECONNECTING refused")
	}
	if ok, old := p.changeStateGetOld(CltPathConnected); ok || old != CltPathReconnecting {
		t.Fatalf("RECONNECTING -> CONNECTED: changed=%v old=%v", ok, old)
	}
}

func TestSrvStateTable(t *testing.T) {
	states := []SrvPathState{SrvPathConnecting, SrvPathConnected, SrvPathClosing, SrvPathClosed}
	allowed := map[[2]SrvPathState]bool{
		{SrvPathConnecting, SrvPathConnected}: true,
		{SrvPathConnecting, SrvPathClosing}:   true,
		{SrvPathConnected, SrvPathClosing}:    true,
		{SrvPathClosing, SrvPathClosed}:       true,
	}
	for _, from := range states {
		for _, to := range states {
			p := &SrvPath{sess: &SrvSession{srv: &Server{}}}
			p.state.Store(int32(from))
			got := p.changeState(to)
			if want := allowed[[2]SrvPathState{from, to}]; got != want {
				t.Errorf("%v -> %v: changed=%v, want %v", from, to, got, want)
			}
		}
	}
}

func TestStateStrings(t *testing.T) {
	if CltPathConnected.SysfsString() != "connected" || CltPathReconnecting.SysfsString() != "disconnected" {
		t.Fatal("sysfs state strings")
	}
	if CltPathConnectingErr.String() != "CONNECTING_ERR" || CltPathDead.String() != "DEAD" {
		t.Fatal("state names")
	}
}
