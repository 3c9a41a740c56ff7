package clientd

import (
	"context"
	"strings"
	"testing"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
)

// mirrorMapping is a mirror of the rig's file dev over legs on the
// storage nodes at the addresses given (10.30.0.N), sessions m-N.
func mirrorMapping(dev string, nodes ...int) api.Mapping {
	m := api.Mapping{Mirror: "m1"}
	for _, n := range nodes {
		m.Legs = append(m.Legs, api.Leg{SessName: "m-" + string(rune('0'+n)), DevicePath: dev,
			Paths: []string{"ip:10.30.0.2@ip:10.30.0." + string(rune('0'+n))}})
	}
	return m
}

// Mirror mappings the daemon must refuse before it dials anything, and
// the ones it refuses for what it found: a session shared with a leg, a
// second mapping of one mirror, legs without a mirror's metadata.
func TestMirrorMapRefusals(t *testing.T) {
	r := newRig(t)
	r.file("a", 16<<20)
	d := r.start()
	defer d.Stop()
	ctx := context.Background()
	with := func(f func(*api.Mapping)) api.Mapping {
		m := mirrorMapping("a", 1, 3)
		f(&m)
		return m
	}
	for name, c := range map[string]struct {
		m    api.Mapping
		code ctl.Code
		says string
	}{
		"one leg":                     {with(func(m *api.Mapping) { m.Legs = m.Legs[:1] }), ctl.CodeInvalid, "2 or 3 legs"},
		"four legs":                   {with(func(m *api.Mapping) { m.Legs = append(m.Legs, m.Legs...) }), ctl.CodeInvalid, "2 or 3 legs"},
		"no name":                     {with(func(m *api.Mapping) { m.Mirror = "" }), ctl.CodeInvalid, "--mirror NAME"},
		"spaced name":                 {with(func(m *api.Mapping) { m.Mirror = "a b" }), ctl.CodeInvalid, "without spaces"},
		"migration":                   {with(func(m *api.Mapping) { m.AccessMode = "migration" }), ctl.CodeInvalid, "one client only"},
		"read-only":                   {with(func(m *api.Mapping) { m.AccessMode = "ro" }), ctl.CodeInvalid, "one client only"},
		"one node":                    {with(func(m *api.Mapping) { m.Legs[1].Paths = m.Legs[0].Paths }), ctl.CodeInvalid, "one storage node"},
		"one session":                 {with(func(m *api.Mapping) { m.Legs[1].SessName = m.Legs[0].SessName }), ctl.CodeInvalid, "one session"},
		"spare on a leg's node":       {with(func(m *api.Mapping) { m.Spares = []api.Leg{m.Legs[0]}; m.Spares[0].SessName = "sp" }), ctl.CodeInvalid, "leg 0 and spare 0 are on one storage node"},
		"spare with a leg's session":  {with(func(m *api.Mapping) { m.Spares = mirrorMapping("a", 4).Legs; m.Spares[0].SessName = "m-1" }), ctl.CodeInvalid, "one session"},
		"four spares":                 {with(func(m *api.Mapping) { m.Spares = mirrorMapping("a", 4, 5, 6, 7).Legs }), ctl.CodeInvalid, "4 spares"},
		"with sessname":               {with(func(m *api.Mapping) { m.SessName = "s1" }), ctl.CodeInvalid, "--leg for each"},
		"force by none":               {with(func(m *api.Mapping) { m.Force = &api.MirrorForce{From: -1} }), ctl.CodeInvalid, "who orders it"},
		"force from 5":                {with(func(m *api.Mapping) { m.Force = &api.MirrorForce{By: "me", From: 5} }), ctl.CodeInvalid, "legs 0 to 1"},
		"create twice":                {with(func(m *api.Mapping) { m.Create, m.CreateIfNew = true, true }), ctl.CodeInvalid, "together"},
		"create if new, force":        {with(func(m *api.Mapping) { m.CreateIfNew, m.Force = true, &api.MirrorForce{By: "me", From: -1} }), ctl.CodeInvalid, "together"},
		"create if new one":           {api.Mapping{SessName: "s1", Paths: []string{"ip:10.30.0.1"}, DevicePath: "a", CreateIfNew: true}, ctl.CodeInvalid, "for a mirror"},
		"create if new without a leg": {with(func(m *api.Mapping) { m.CreateIfNew = true }), ctl.CodeUnavailable, "was not reached"},
		"create, force":               {with(func(m *api.Mapping) { m.Create, m.Force = true, &api.MirrorForce{By: "me", From: -1} }), ctl.CodeInvalid, "together"},
		"region, no create":           {with(func(m *api.Mapping) { m.RegionSize = "1MiB" }), ctl.CodeInvalid, "with create"},
		"bad region":                  {with(func(m *api.Mapping) { m.Create, m.RegionSize = true, "4 furlongs" }), ctl.CodeInvalid, "region_size"},
		"size of one":                 {api.Mapping{SessName: "s1", Paths: []string{"ip:10.30.0.1"}, DevicePath: "a", Size: "1GiB"}, ctl.CodeInvalid, "for a mirror"},
		"bad size":                    {with(func(m *api.Mapping) { m.Size = "1000" }), ctl.CodeInvalid, "multiple of 4096"},
		"create one":                  {api.Mapping{SessName: "s1", Paths: []string{"ip:10.30.0.1"}, DevicePath: "a", Create: true}, ctl.CodeInvalid, "for a mirror"},
		// Only one storage node answers (the rig's, 10.30.0.1).
		"create without a leg": {with(func(m *api.Mapping) { m.Create = true }), ctl.CodeUnavailable, "create needs every leg"},
		"no metadata":          {mirrorMapping("a", 1), ctl.CodeInvalid, "2 or 3 legs"},
	} {
		_, err := d.Map(ctx, c.m)
		if ctl.Classify(err) != c.code || err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %v (%s), want %s saying %q", name, err, ctl.Classify(err), c.code, c.says)
		}
	}
	// A leg's session is the mirror's own: a mapping may not share one
	// with it, nor a mirror a mapping's.
	if _, err := d.Map(ctx, r.mapping("s9", "a")); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Map(ctx, with(func(m *api.Mapping) { m.Legs[0].SessName = "s9" })); ctl.Classify(err) != ctl.CodeExists || !strings.Contains(err.Error(), "session of its own") {
		t.Fatalf("a mirror's leg through a mapping's session: %v", err)
	}
	if n := len(d.deviceRecords("")); n != 1 {
		t.Fatalf("%d devices after the refusals", n)
	}
	if n := len(d.sessionList()); n != 1 {
		t.Fatalf("%d sessions after the refusals", n)
	}
}
