package lint

import (
	"go/ast"
	"go/parser"
	"go/token"
	"net"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/rnbd/rnbd/internal/csi"
)

// The checks of checkDeployment on each pod: what operators of ceph-csi,
// TopoLVM or piraeus expect of a CSI driver's pods (issue 40, section 4).

// driverFlags are the flags cmd/rnbd-csi defines, read from its source:
// the names given to f.StringVar and its kind.
var driverFlags = sync.OnceValues(func() ([]string, error) {
	fs := token.NewFileSet()
	f, err := parser.ParseFile(fs, "../../cmd/rnbd-csi/main.go", nil, 0)
	if err != nil {
		return nil, err
	}
	var names []string
	ast.Inspect(f, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		if !ok || len(call.Args) < 2 {
			return true
		}
		if x, ok := sel.X.(*ast.Ident); !ok || x.Name != "f" || !strings.HasSuffix(sel.Sel.Name, "Var") {
			return true
		}
		if lit, ok := call.Args[1].(*ast.BasicLit); ok && lit.Kind == token.STRING {
			if name, err := strconv.Unquote(lit.Value); err == nil {
				names = append(names, name)
			}
		}
		return true
	})
	return names, nil
})

// checkDriverArgs: every argument of the rnbd-csi container is a flag
// cmd/rnbd-csi has, as --name=value, and its log level one it takes.
func checkDriverArgs(t *testing.T, p pod) {
	t.Helper()
	names, err := driverFlags()
	if err != nil {
		t.Fatalf("cmd/rnbd-csi/main.go: %v", err)
	}
	if len(names) < 5 {
		t.Fatalf("cmd/rnbd-csi/main.go: found the flags %v only: has the way it defines them changed?", names)
	}
	d := driverContainer(t, p)
	for _, a := range d.Args {
		name, _, ok := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") || !ok {
			t.Errorf("%s: rnbd-csi argument %q: want --name=value", p.what, a)
			continue
		}
		if !slices.Contains(names, name) {
			t.Errorf("%s: rnbd-csi argument %q: rnbd-csi has no flag --%s (it has %v)", p.what, a, name, names)
		}
	}
	if lv, ok := flag(d.Args, "log-level"); ok && !slices.Contains([]string{"debug", "info", "warning", "error"}, lv) {
		t.Errorf("%s: rnbd-csi --log-level=%q: want debug, info, warning or error", p.what, lv)
	}
}

// checkResources: every container requests CPU and memory (what the
// scheduler reserves) and has a memory limit (what bounds a leak).
func checkResources(t *testing.T, p pod) {
	t.Helper()
	for _, c := range p.spec.Containers {
		r := c.Resources
		for _, want := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			if q, ok := r.Requests[want]; !ok || q.IsZero() {
				t.Errorf("%s: %s requests no %s", p.what, c.Name, want)
			}
		}
		if q, ok := r.Limits[corev1.ResourceMemory]; !ok || q.IsZero() {
			t.Errorf("%s: %s has no memory limit", p.what, c.Name)
		} else if req, ok := r.Requests[corev1.ResourceMemory]; ok && q.Cmp(req) < 0 {
			t.Errorf("%s: %s's memory limit %s is below its request %s", p.what, c.Name, q.String(), req.String())
		}
	}
}

// confined: the container gets no privilege, no capability and cannot
// write its root file system.
func confined(c *corev1.Container) string {
	sc := c.SecurityContext
	switch {
	case sc == nil:
		return "no securityContext"
	case sc.Privileged != nil && *sc.Privileged:
		return "privileged"
	case sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation:
		return "allowPrivilegeEscalation not false"
	case sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem:
		return "readOnlyRootFilesystem not true"
	case sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL"):
		return "capabilities not dropped (drop: [ALL])"
	case len(sc.Capabilities.Add) > 0:
		return "capabilities added"
	}
	return ""
}

// runsAs is the user a container runs as, and whether runAsNonRoot
// holds it to a non-root one, from its securityContext over its pod's.
func runsAs(p pod, c *corev1.Container) (uid *int64, nonRoot bool) {
	if ps := p.spec.SecurityContext; ps != nil {
		uid = ps.RunAsUser
		nonRoot = ps.RunAsNonRoot != nil && *ps.RunAsNonRoot
	}
	if cs := c.SecurityContext; cs != nil {
		if cs.RunAsUser != nil {
			uid = cs.RunAsUser
		}
		if cs.RunAsNonRoot != nil {
			nonRoot = *cs.RunAsNonRoot
		}
	}
	return uid, nonRoot
}

// checkControllerSecurity: no container of the controller is root or
// has a privilege, capability or a writable root; the files of the
// Secrets it mounts are readable by the group fsGroup gives it.
func checkControllerSecurity(t *testing.T, p pod) {
	t.Helper()
	for i := range p.spec.Containers {
		c := &p.spec.Containers[i]
		if why := confined(c); why != "" {
			t.Errorf("%s: %s: %s", p.what, c.Name, why)
		}
		uid, nonRoot := runsAs(p, c)
		if !nonRoot || uid == nil || *uid == 0 {
			t.Errorf("%s: %s may run as root (runAsNonRoot %v, runAsUser %v): none of the controller's containers needs it", p.what, c.Name, nonRoot, uid)
		}
	}
	ps := p.spec.SecurityContext
	if ps == nil || ps.SeccompProfile == nil || ps.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("%s: no seccompProfile RuntimeDefault", p.what)
	}
	for _, v := range p.spec.Volumes {
		if v.Secret == nil {
			continue
		}
		if ps == nil || ps.FSGroup == nil {
			t.Errorf("%s: mounts the Secret %s but sets no fsGroup: its files are root's, which the containers are not", p.what, v.Secret.SecretName)
		}
		if mode := v.Secret.DefaultMode; mode != nil && *mode&0o040 == 0 {
			t.Errorf("%s: the Secret %s's files are %#o, not readable by the group fsGroup gives the containers", p.what, v.Secret.SecretName, *mode)
		}
	}
}

// checkNodeSecurity: the node plugin's sidecars are confined (they run as
// root: the registrar writes in the kubelet's root-owned plugin registry
// and both connect to the socket rnbd-csi, root, makes).
func checkNodeSecurity(t *testing.T, p pod) {
	t.Helper()
	d := driverContainer(t, p)
	for i := range p.spec.Containers {
		c := &p.spec.Containers[i]
		if c.Name == d.Name {
			continue
		}
		if why := confined(c); why != "" {
			t.Errorf("%s: %s: %s", p.what, c.Name, why)
		}
		if sc := c.SecurityContext; sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("%s: %s has no seccompProfile RuntimeDefault", p.what, c.Name)
		}
	}
}

// listenPort is the port of a listen address (":9808", "0.0.0.0:9808").
func listenPort(addr string) (int32, bool) {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, false
	}
	n, err := strconv.ParseInt(port, 10, 32)
	return int32(n), err == nil && n > 0 && n < 65536
}

// listeners are the TCP ports the pod's containers listen on, by the
// flags that make them listen: a sidecar's --http-endpoint, rnbd-csi's
// --metrics-listen.
func listeners(t *testing.T, p pod) map[int32]*corev1.Container {
	t.Helper()
	ls := map[int32]*corev1.Container{}
	for i := range p.spec.Containers {
		c := &p.spec.Containers[i]
		for _, f := range []string{"http-endpoint", "metrics-listen"} {
			addr, ok := flag(c.Args, f)
			if !ok {
				continue
			}
			port, ok := listenPort(addr)
			if !ok {
				t.Errorf("%s: %s --%s=%q: want HOST:PORT", p.what, c.Name, f, addr)
				continue
			}
			if o := ls[port]; o != nil {
				t.Errorf("%s: %s and %s both listen on port %d (the pod's containers share its network)", p.what, o.Name, c.Name, port)
			}
			ls[port] = c
		}
		if slices.ContainsFunc(c.Args, func(a string) bool {
			return strings.HasPrefix(a, "--health-port") || strings.HasPrefix(a, "--metrics-address")
		}) {
			t.Errorf("%s: %s uses --health-port or --metrics-address, which the sidecars deprecated for --http-endpoint", p.what, c.Name)
		}
	}
	return ls
}

// containerPort resolves a probe's or a Service's port: a name, of
// c's ports (a probe's) or of any container's (c nil, a Service's); a
// number as it is.
func containerPort(p pod, c *corev1.Container, port intstr.IntOrString) (int32, bool) {
	if port.Type == intstr.Int {
		return port.IntVal, true
	}
	for _, o := range p.spec.Containers {
		if c != nil && o.Name != c.Name {
			continue
		}
		for _, cp := range o.Ports {
			if cp.Name == port.StrVal {
				return cp.ContainerPort, true
			}
		}
	}
	return 0, false
}

// checkProbesAndPorts: every port a container listens on is declared, once
// in the pod; every probe asks a port something listens on; the driver
// has a liveness and a readiness probe on livenessprobe's /healthz (its
// Probe); the registrar a liveness probe on its own /healthz (not its
// --mode=kubelet-registration-probe, which does nothing since v2.9.0);
// each sidecar that elects a leader one on /healthz/leader-election.
func checkProbesAndPorts(t *testing.T, p pod) {
	t.Helper()
	ls := listeners(t, p)
	declared := map[int32]bool{}
	names := map[string]bool{}
	for _, c := range p.spec.Containers {
		for _, cp := range c.Ports {
			if declared[cp.ContainerPort] {
				t.Errorf("%s: port %d declared twice", p.what, cp.ContainerPort)
			}
			if cp.Name != "" && names[cp.Name] {
				t.Errorf("%s: port name %s given twice", p.what, cp.Name)
			}
			declared[cp.ContainerPort], names[cp.Name] = true, true
			if ls[cp.ContainerPort] == nil {
				t.Errorf("%s: %s declares port %d (%s), on which nothing listens", p.what, c.Name, cp.ContainerPort, cp.Name)
			}
			if cp.HostPort != 0 {
				t.Errorf("%s: %s takes the host's port %d", p.what, c.Name, cp.HostPort)
			}
		}
	}
	for port, c := range ls {
		if !declared[port] {
			t.Errorf("%s: %s listens on port %d, which no container declares (a probe or Service names it)", p.what, c.Name, port)
		}
	}
	// httpProbe is the probe's path and the container that answers it.
	httpProbe := func(c *corev1.Container, pr *corev1.Probe) (string, *corev1.Container) {
		t.Helper()
		if pr == nil {
			return "", nil
		}
		if pr.Exec != nil && slices.Contains(pr.Exec.Command, "--mode=kubelet-registration-probe") {
			t.Errorf("%s: %s's probe runs --mode=kubelet-registration-probe, which exits 0 whatever the registration (node-driver-registrar v2.9.0 on): probe its --http-endpoint's /healthz", p.what, c.Name)
		}
		if pr.HTTPGet == nil {
			return "", nil
		}
		port, ok := containerPort(p, c, pr.HTTPGet.Port)
		if !ok {
			t.Errorf("%s: %s's probe names port %q, which is not one of its own", p.what, c.Name, pr.HTTPGet.Port.String())
			return pr.HTTPGet.Path, nil
		}
		if ls[port] == nil {
			t.Errorf("%s: %s's probe asks port %d, on which nothing listens", p.what, c.Name, port)
		}
		return pr.HTTPGet.Path, ls[port]
	}
	d := driverContainer(t, p)
	for i := range p.spec.Containers {
		c := &p.spec.Containers[i]
		live, liveBy := httpProbe(c, c.LivenessProbe)
		ready, readyBy := httpProbe(c, c.ReadinessProbe)
		httpProbe(c, c.StartupProbe)
		name, _, _ := strings.Cut(path.Base(c.Image), ":")
		_, endpoint := flag(c.Args, "http-endpoint")
		switch {
		case c.Name == d.Name:
			for _, pr := range []struct {
				what, path string
				by         *corev1.Container
			}{{"liveness", live, liveBy}, {"readiness", ready, readyBy}} {
				if pr.by == nil || !strings.HasPrefix(pr.by.Image, "registry.k8s.io/sig-storage/livenessprobe:") || pr.path != "/healthz" {
					t.Errorf("%s: rnbd-csi has no %s probe on livenessprobe's /healthz (the driver's Probe)", p.what, pr.what)
				}
			}
		case name == "livenessprobe":
			if !endpoint {
				t.Errorf("%s: %s has no --http-endpoint, where rnbd-csi's probes ask it", p.what, c.Name)
			}
		case name == "csi-node-driver-registrar":
			if liveBy != c || live != "/healthz" {
				t.Errorf("%s: %s has no liveness probe on its --http-endpoint's /healthz (is its registration socket there and answering?)", p.what, c.Name)
			}
			if _, ok := flag(c.Args, "mode"); ok {
				t.Errorf("%s: %s has --mode, which is deprecated", p.what, c.Name)
			}
		case slices.Contains(c.Args, "--leader-election"):
			if liveBy != c || live != "/healthz/leader-election" {
				t.Errorf("%s: %s has no liveness probe on its --http-endpoint's /healthz/leader-election", p.what, c.Name)
			}
		}
	}
}

// checkMetrics: rnbd-csi serves metrics where they are wanted, and then a
// Service of the pod's namespace selects the pod and has a port for it
// and for each sidecar's --http-endpoint that serves /metrics (all but
// the registrar's).
func checkMetrics(t *testing.T, m *manifests, p pod, wanted bool) {
	t.Helper()
	d := driverContainer(t, p)
	addr, ok := flag(d.Args, "metrics-listen")
	if ok != wanted {
		t.Errorf("%s: rnbd-csi --metrics-listen %v, want %v", p.what, ok, wanted)
	}
	if !ok {
		return
	}
	want := map[int32]string{}
	if port, ok := listenPort(addr); ok {
		want[port] = "rnbd-csi"
	}
	for _, c := range p.spec.Containers {
		if strings.Contains(c.Image, "/csi-node-driver-registrar:") {
			continue // its endpoint has /healthz only
		}
		if a, ok := flag(c.Args, "http-endpoint"); ok {
			if port, ok := listenPort(a); ok {
				want[port] = c.Name
			}
		}
	}
	var tmpl map[string]string
	for _, dep := range m.deployments {
		if "Deployment "+dep.Name == p.what {
			tmpl = dep.Spec.Template.Labels
		}
	}
	for _, ds := range m.daemonSets {
		if "DaemonSet "+ds.Name == p.what {
			tmpl = ds.Spec.Template.Labels
		}
	}
	got := map[int32]bool{}
	for _, s := range m.services {
		if s.Namespace != p.namespace || len(s.Spec.Selector) == 0 || !labels.SelectorFromSet(s.Spec.Selector).Matches(labels.Set(tmpl)) {
			continue
		}
		for _, sp := range s.Spec.Ports {
			port, ok := containerPort(p, nil, sp.TargetPort)
			if !ok {
				t.Errorf("Service %s: port %s targets %q, which no container of %s declares", s.Name, sp.Name, sp.TargetPort.String(), p.what)
			}
			got[port] = true
		}
	}
	for port, who := range want {
		if !got[port] {
			t.Errorf("%s: no Service selecting it has a port for %s's metrics (port %d)", p.what, who, port)
		}
	}
}

// checkControllerReplicas: more than one controller replica, spread over
// the nodes where the scheduler can, and a drain takes one at a time.
func checkControllerReplicas(t *testing.T, m *manifests, p pod, ha bool) {
	t.Helper()
	dep := m.deployments[0]
	tmpl := labels.Set(dep.Spec.Template.Labels)
	for _, b := range m.budgets {
		sel, err := metav1.LabelSelectorAsSelector(b.Spec.Selector)
		if err != nil || b.Namespace != p.namespace || !sel.Matches(tmpl) {
			t.Errorf("PodDisruptionBudget %s does not select %s's pods", b.Name, p.what)
		}
	}
	if !ha {
		return
	}
	if r := dep.Spec.Replicas; r == nil || *r < 2 {
		n := int32(1) // the default
		if r != nil {
			n = *r
		}
		t.Errorf("%s: %d replicas, want 2 or more (the sidecars elect a leader; the other takes over)", p.what, n)
	}
	if len(m.budgets) != 1 {
		t.Errorf("%s: %d PodDisruptionBudgets, want 1", p.what, len(m.budgets))
	} else if mu := m.budgets[0].Spec.MaxUnavailable; mu == nil || mu.String() != "1" {
		t.Errorf("PodDisruptionBudget %s: maxUnavailable %v, want 1", m.budgets[0].Name, mu)
	}
	spread := false
	if a := p.spec.Affinity; a != nil && a.PodAntiAffinity != nil {
		for _, w := range a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
			sel, err := metav1.LabelSelectorAsSelector(w.PodAffinityTerm.LabelSelector)
			if err == nil && w.PodAffinityTerm.TopologyKey == "kubernetes.io/hostname" && sel.Matches(tmpl) {
				spread = true
			}
		}
	}
	if !spread {
		t.Errorf("%s: no preferred pod anti-affinity by kubernetes.io/hostname between its replicas", p.what)
	}
}

// checkCapacity: the CSIDriver's storageCapacity is external-provisioner's
// --enable-capacity; with it, the provisioner knows its pod and namespace,
// owns the CSIStorageCapacity objects by the Deployment (pod, ReplicaSet,
// Deployment: level 2), and may keep them and walk there. A default file
// system is given in any case.
func checkCapacity(t *testing.T, m *manifests, p pod, wanted bool) {
	t.Helper()
	var prov *corev1.Container
	for i, c := range p.spec.Containers {
		if strings.Contains(c.Image, "/csi-provisioner:") {
			prov = &p.spec.Containers[i]
		}
	}
	if prov == nil {
		t.Errorf("%s has no csi-provisioner", p.what)
		return
	}
	if fs, _ := flag(prov.Args, "default-fstype"); fs != "ext4" && fs != "xfs" {
		t.Errorf("%s: %s --default-fstype=%q, want ext4 or xfs (the file system of a StorageClass that names none)", p.what, prov.Name, fs)
	}
	sc := m.csiDrivers[0].Spec.StorageCapacity
	enabled := slices.Contains(prov.Args, "--enable-capacity")
	if (sc != nil && *sc) != enabled {
		t.Errorf("%s: CSIDriver storageCapacity %v, but %s --enable-capacity %v: the scheduler waits for objects no one makes, or ignores those made", p.what, sc, prov.Name, enabled)
	}
	if enabled != wanted {
		t.Errorf("%s: %s --enable-capacity %v, want %v", p.what, prov.Name, enabled, wanted)
	}
	if !enabled {
		return
	}
	if lv, _ := flag(prov.Args, "capacity-ownerref-level"); lv != "2" {
		t.Errorf("%s: %s --capacity-ownerref-level=%q, want 2 (pod, ReplicaSet, Deployment)", p.what, prov.Name, lv)
	}
	for name, field := range map[string]string{"POD_NAME": "metadata.name", "NAMESPACE": "metadata.namespace"} {
		if !slices.ContainsFunc(prov.Env, func(e corev1.EnvVar) bool {
			return e.Name == name && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == field
		}) {
			t.Errorf("%s: %s has no env %s from %s", p.what, prov.Name, name, field)
		}
	}
	sa := p.spec.ServiceAccountName
	for _, r := range []struct {
		group, resource string
		verbs           []string
	}{
		{"storage.k8s.io", "csistoragecapacities", []string{"get", "list", "watch", "create", "update", "patch", "delete"}},
		{"", "pods", []string{"get"}},
		{"apps", "replicasets", []string{"get"}},
	} {
		if !mayInNamespace(m, p.namespace, sa, p.namespace, r.group, r.resource, r.verbs...) {
			t.Errorf("%s: service account %s may not %v %s in %s, which storage capacity tracking needs", p.what, sa, r.verbs, r.resource, p.namespace)
		}
	}
}

// checkConfig: the ConfigMap both pods mount at rnbd-csi's --config is a
// configuration the driver loads as it is, for the controller and, given
// a node id, for the node plugin; its driver name is the CSIDriver's; the
// controller's certificate files are in the Secret it mounts; the client
// daemon's socket is in the host's directory the node plugin mounts.
func checkConfig(t *testing.T, m *manifests, controller, node pod, d deployment) {
	t.Helper()
	var cfgs [2]csi.Config
	for i, p := range []pod{controller, node} {
		c := driverContainer(t, p)
		file, _ := flag(c.Args, "config")
		vm := mountOf(c, file)
		if vm == nil || vm.SubPath == "" || path.Clean(vm.MountPath) != path.Clean(file) {
			t.Errorf("%s: rnbd-csi's --config=%s is not a key of a mounted ConfigMap", p.what, file)
			return
		}
		v := volumeNamed(p, vm.Name)
		if v == nil || v.ConfigMap == nil {
			t.Errorf("%s: rnbd-csi's --config=%s is not on a ConfigMap", p.what, file)
			return
		}
		var text string
		for _, cm := range m.configMaps {
			if cm.Name == v.ConfigMap.Name {
				text = cm.Data[vm.SubPath]
			}
		}
		tmp := filepath.Join(t.TempDir(), "csi.toml")
		if err := os.WriteFile(tmp, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := csi.LoadConfig(tmp)
		if err != nil {
			t.Errorf("%s: the ConfigMap %s's %s: %v", p.what, v.ConfigMap.Name, vm.SubPath, err)
			return
		}
		cfgs[i] = cfg
	}
	if err := cfgs[0].ValidateController(); err != nil {
		t.Errorf("%s: its configuration, for the controller: %v", controller.what, err)
	}
	cfgs[1].Node.NodeID = "worker-1" // --node-id=$(KUBE_NODE_NAME)
	if err := cfgs[1].ValidateNode(); err != nil {
		t.Errorf("%s: its configuration, for the node plugin: %v", node.what, err)
	}
	if cfgs[0].DriverName != d.driver {
		t.Errorf("%s: driver_name %q, but the CSIDriver is %q", d.what, cfgs[0].DriverName, d.driver)
	}

	// The certificate, key and authority: files of the Secret the
	// controller's rnbd-csi mounts.
	c := driverContainer(t, controller)
	for _, file := range []string{cfgs[0].TLS.Cert, cfgs[0].TLS.Key, cfgs[0].TLS.CA} {
		vm := mountOf(c, file)
		var v *corev1.Volume
		if vm != nil {
			v = volumeNamed(controller, vm.Name)
		}
		if v == nil || v.Secret == nil {
			t.Errorf("%s: [tls] names %s, which is on no Secret rnbd-csi mounts", controller.what, file)
			continue
		}
		key := strings.TrimPrefix(path.Clean(file), path.Clean(vm.MountPath)+"/")
		keys := []string{"tls.crt", "tls.key", "ca.crt"} // an external Secret's layout (examples/secret.yaml)
		for _, s := range m.secrets {
			if s.Name == v.Secret.SecretName {
				keys = slices.Concat(slices.Collect(mapKeys(s.StringData)), slices.Collect(mapKeys(bytesKeys(s.Data))))
			}
		}
		if !slices.Contains(keys, key) {
			t.Errorf("%s: [tls] names %s, key %q of the Secret %s, which has %v", controller.what, file, key, v.Secret.SecretName, keys)
		}
	}

	// The client daemon's socket: in the host's directory, at the same path.
	nd := driverContainer(t, node)
	dir := path.Dir(cfgs[1].Node.ClientSocket)
	vm := mountOf(nd, cfgs[1].Node.ClientSocket)
	if vm == nil || path.Clean(vm.MountPath) != dir {
		t.Errorf("%s: rnbd-csi does not mount the host's %s, where the client daemon's socket %s is", node.what, dir, cfgs[1].Node.ClientSocket)
	} else if v := volumeNamed(node, vm.Name); v == nil || v.HostPath == nil || path.Clean(v.HostPath.Path) != dir {
		t.Errorf("%s: rnbd-csi's %s is not the host's", node.what, dir)
	}
}
