package lint

import (
	"bytes"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// The Kubernetes manifests of rnbd-csi: deploy/kubernetes/*.yaml (applied
// as they are; the Helm chart's default rendering, helm_test.go) and
// deploy/kubernetes/examples/*.yaml (edited first).
var manifestDirs = []string{"../../deploy/kubernetes", "../../deploy/kubernetes/examples"}

// deployment is what a set of manifests is expected to deploy: the plain
// manifests, or a rendering of the chart with some values.
type deployment struct {
	what string // "deploy/kubernetes", "the chart with ci/k0s-values.yaml"
	// namespace is the namespace the objects go to where the manifests
	// make none (a Helm release's); empty, they make their own.
	namespace  string
	driver     string // the CSI driver's name
	kubeletDir string // the kubelet's root directory on the workers
	// externalSecret is the Secret the controller mounts that is made
	// outside the manifests (kubectl create secret), or empty.
	externalSecret string
	// examples: there is a StorageClass and a VolumeSnapshotClass.
	examples bool
	// ha: the controller runs more than one replica, on different nodes
	// where it can, with a disruption budget.
	ha bool
	// metrics: rnbd-csi serves metrics, which Services expose.
	metrics bool
	// capacity: storage capacity tracking.
	capacity bool
}

// plainManifests is what deploy/kubernetes deploys.
var plainManifests = deployment{what: "deploy/kubernetes", driver: "rnbd.csi.rnbd.io", kubeletDir: "/var/lib/kubelet",
	examples: true, ha: true, metrics: true, capacity: true}

// volumeSnapshotClass is snapshot.storage.k8s.io/v1's VolumeSnapshotClass,
// which k8s.io/api does not have: its fields, as the CRD defines them.
type volumeSnapshotClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Driver            string            `json:"driver"`
	DeletionPolicy    string            `json:"deletionPolicy"`
	Parameters        map[string]string `json:"parameters,omitempty"`
}

// manifests is every object of the manifests, decoded.
type manifests struct {
	namespaces      []*corev1.Namespace
	serviceAccounts []*corev1.ServiceAccount
	configMaps      []*corev1.ConfigMap
	secrets         []*corev1.Secret
	csiDrivers      []*storagev1.CSIDriver
	storageClasses  []*storagev1.StorageClass
	snapshotClasses []*volumeSnapshotClass
	clusterRoles    []*rbacv1.ClusterRole
	clusterBindings []*rbacv1.ClusterRoleBinding
	roles           []*rbacv1.Role
	roleBindings    []*rbacv1.RoleBinding
	deployments     []*appsv1.Deployment
	daemonSets      []*appsv1.DaemonSet
	services        []*corev1.Service
	budgets         []*policyv1.PodDisruptionBudget
}

// decodeStrict decodes one object's JSON the way the API server's strict
// field validation does: a field the type does not have, a field given
// twice, or a field in the wrong case is an error.
func decodeStrict(j []byte, into any) error {
	strict, err := kjson.UnmarshalStrict(j, into)
	if err != nil {
		return err
	}
	return errorsJoin(strict)
}

func errorsJoin(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	msgs := make([]string, len(errs))
	for i, e := range errs {
		msgs[i] = e.Error()
	}
	return fmt.Errorf("%s", strings.Join(msgs, "; "))
}

// docSeparator is a YAML document separator line.
var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// loadManifests reads and strictly decodes every YAML document of the
// manifests, each into the type its apiVersion and kind name.
func loadManifests(t *testing.T) *manifests {
	t.Helper()
	m := &manifests{}
	var files []string
	for _, dir := range manifestDirs {
		fs, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, fs...)
	}
	if len(files) == 0 {
		t.Fatalf("no manifests in %v", manifestDirs)
	}
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		m.decode(t, strings.TrimPrefix(file, "../../"), string(b))
	}
	return m
}

// decode strictly decodes every YAML document of text (named name in
// errors) and keeps the objects.
func (m *manifests) decode(t *testing.T, name, text string) {
	t.Helper()
	for i, doc := range docSeparator.Split(text, -1) {
		j, err := yaml.YAMLToJSONStrict([]byte(doc))
		if err != nil {
			t.Errorf("%s document %d: %v", name, i+1, err)
			continue
		}
		if bytes.Equal(bytes.TrimSpace(j), []byte("null")) {
			continue // only comments
		}
		if err := m.add(j); err != nil {
			t.Errorf("%s document %d: %v", name, i+1, err)
		}
	}
}

// add decodes one object into its type and keeps it.
func (m *manifests) add(j []byte) error {
	var tm metav1.TypeMeta
	if err := kjson.UnmarshalCaseSensitivePreserveInts(j, &tm); err != nil {
		return err
	}
	var obj any
	switch tm.APIVersion + " " + tm.Kind {
	case "v1 Namespace":
		o := &corev1.Namespace{}
		m.namespaces, obj = append(m.namespaces, o), o
	case "v1 ServiceAccount":
		o := &corev1.ServiceAccount{}
		m.serviceAccounts, obj = append(m.serviceAccounts, o), o
	case "v1 ConfigMap":
		o := &corev1.ConfigMap{}
		m.configMaps, obj = append(m.configMaps, o), o
	case "v1 Secret":
		o := &corev1.Secret{}
		m.secrets, obj = append(m.secrets, o), o
	case "storage.k8s.io/v1 CSIDriver":
		o := &storagev1.CSIDriver{}
		m.csiDrivers, obj = append(m.csiDrivers, o), o
	case "storage.k8s.io/v1 StorageClass":
		o := &storagev1.StorageClass{}
		m.storageClasses, obj = append(m.storageClasses, o), o
	case "snapshot.storage.k8s.io/v1 VolumeSnapshotClass":
		o := &volumeSnapshotClass{}
		m.snapshotClasses, obj = append(m.snapshotClasses, o), o
	case "rbac.authorization.k8s.io/v1 ClusterRole":
		o := &rbacv1.ClusterRole{}
		m.clusterRoles, obj = append(m.clusterRoles, o), o
	case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
		o := &rbacv1.ClusterRoleBinding{}
		m.clusterBindings, obj = append(m.clusterBindings, o), o
	case "rbac.authorization.k8s.io/v1 Role":
		o := &rbacv1.Role{}
		m.roles, obj = append(m.roles, o), o
	case "rbac.authorization.k8s.io/v1 RoleBinding":
		o := &rbacv1.RoleBinding{}
		m.roleBindings, obj = append(m.roleBindings, o), o
	case "apps/v1 Deployment":
		o := &appsv1.Deployment{}
		m.deployments, obj = append(m.deployments, o), o
	case "apps/v1 DaemonSet":
		o := &appsv1.DaemonSet{}
		m.daemonSets, obj = append(m.daemonSets, o), o
	case "v1 Service":
		o := &corev1.Service{}
		m.services, obj = append(m.services, o), o
	case "policy/v1 PodDisruptionBudget":
		o := &policyv1.PodDisruptionBudget{}
		m.budgets, obj = append(m.budgets, o), o
	default:
		return fmt.Errorf("apiVersion %q kind %q: not a kind the manifests should have", tm.APIVersion, tm.Kind)
	}
	if err := decodeStrict(j, obj); err != nil {
		return fmt.Errorf("%s: %v", tm.Kind, err)
	}
	return nil
}

// pod is a workload's pod template with the workload's name and namespace.
type pod struct {
	what      string // "Deployment rnbd-csi-controller"
	namespace string
	spec      *corev1.PodSpec
}

func (m *manifests) pods() []pod {
	var ps []pod
	for _, d := range m.deployments {
		ps = append(ps, pod{"Deployment " + d.Name, d.Namespace, &d.Spec.Template.Spec})
	}
	for _, d := range m.daemonSets {
		ps = append(ps, pod{"DaemonSet " + d.Name, d.Namespace, &d.Spec.Template.Spec})
	}
	return ps
}

// flag is the value of --name=VALUE in args, and whether it is there.
func flag(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

// driverContainer is the pod's rnbd-csi container: the one with --endpoint.
func driverContainer(t *testing.T, p pod) *corev1.Container {
	t.Helper()
	var found *corev1.Container
	for i := range p.spec.Containers {
		c := &p.spec.Containers[i]
		if _, ok := flag(c.Args, "endpoint"); ok {
			if found != nil {
				t.Fatalf("%s: two containers with --endpoint (%s, %s)", p.what, found.Name, c.Name)
			}
			found = c
		}
	}
	if found == nil {
		t.Fatalf("%s: no container with --endpoint (the rnbd-csi driver)", p.what)
	}
	return found
}

// mountOf is the volume mount of c whose mount path holds file (the
// longest such), or nil.
func mountOf(c *corev1.Container, file string) *corev1.VolumeMount {
	var best *corev1.VolumeMount
	for i := range c.VolumeMounts {
		vm := &c.VolumeMounts[i]
		mp := path.Clean(vm.MountPath)
		if (file == mp || strings.HasPrefix(file, mp+"/")) && (best == nil || len(mp) > len(path.Clean(best.MountPath))) {
			best = vm
		}
	}
	return best
}

func volumeNamed(p pod, name string) *corev1.Volume {
	for i := range p.spec.Volumes {
		if p.spec.Volumes[i].Name == name {
			return &p.spec.Volumes[i]
		}
	}
	return nil
}

// TestKubernetesManifests: the manifests in deploy/kubernetes decode
// strictly into the Kubernetes API's types (no unknown field, none
// twice), and what they name of each other agrees (checkDeployment).
// The sidecars' versions are those docs/kubernetes.md names.
func TestKubernetesManifests(t *testing.T) {
	m := loadManifests(t)
	if t.Failed() {
		t.FailNow()
	}
	checkDeployment(t, m, plainManifests)

	b, err := os.ReadFile("../../docs/kubernetes.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := strings.Join(strings.Fields(string(b)), " ")
	for _, p := range m.pods() {
		for _, c := range p.spec.Containers {
			if !pinnedSidecar.MatchString(c.Image) {
				continue
			}
			name, tag, _ := strings.Cut(path.Base(c.Image), ":")
			if !strings.Contains(doc, name+" "+tag) {
				t.Errorf("%s: %s runs %s %s, which docs/kubernetes.md does not name", p.what, c.Name, name, tag)
			}
		}
	}
}

// checkDeployment: what the manifests name of each other agrees: the
// driver's name, the CSI socket, the service accounts and what binds
// them, the volumes each container mounts, the Secrets and ConfigMaps
// they come from, the node plugin's mount propagation and kubelet
// directory, the sidecars' images; and each pod is as a cluster's
// operators expect (kubernetes_pods_test.go): resources, security
// contexts, probes, metrics, storage capacity, the controller's
// replicas.
func checkDeployment(t *testing.T, m *manifests, d deployment) {
	t.Helper()
	// One driver, named alike everywhere.
	if len(m.csiDrivers) != 1 {
		t.Fatalf("%s: %d CSIDriver objects, want 1", d.what, len(m.csiDrivers))
	}
	driver := m.csiDrivers[0].Name
	if driver != d.driver {
		t.Errorf("%s: CSIDriver is %q, want %s (the name the driver reports in GetPluginInfo)", d.what, driver, d.driver)
	}
	if d.examples && (len(m.storageClasses) == 0 || len(m.snapshotClasses) == 0) {
		t.Errorf("%s: %d StorageClass and %d VolumeSnapshotClass examples, want at least one of each", d.what, len(m.storageClasses), len(m.snapshotClasses))
	}
	for _, sc := range m.storageClasses {
		if sc.Provisioner != driver {
			t.Errorf("%s: StorageClass %s: provisioner %q, want %q", d.what, sc.Name, sc.Provisioner, driver)
		}
		if _, ok := sc.Parameters["fsType"]; ok {
			t.Errorf("%s: StorageClass %s: parameter fsType, which external-provisioner deprecated: give csi.storage.k8s.io/fstype", d.what, sc.Name)
		}
	}
	for _, vsc := range m.snapshotClasses {
		if vsc.Driver != driver {
			t.Errorf("%s: VolumeSnapshotClass %s: driver %q, want %q", d.what, vsc.Name, vsc.Driver, driver)
		}
		if vsc.DeletionPolicy != "Delete" && vsc.DeletionPolicy != "Retain" {
			t.Errorf("%s: VolumeSnapshotClass %s: deletionPolicy %q, want Delete or Retain", d.what, vsc.Name, vsc.DeletionPolicy)
		}
	}

	// Every namespaced object is in a namespace the manifests make (or
	// the release's).
	namespaces := map[string]bool{}
	for _, ns := range m.namespaces {
		namespaces[ns.Name] = true
	}
	if d.namespace != "" {
		if len(m.namespaces) > 0 {
			t.Errorf("%s: makes Namespace objects: a Helm release's namespace is made before it (helm install --create-namespace, or kubectl)", d.what)
		}
		namespaces = map[string]bool{d.namespace: true}
	}
	namespaced := map[string]string{}
	for _, o := range m.serviceAccounts {
		namespaced["ServiceAccount "+o.Name] = o.Namespace
	}
	for _, o := range m.configMaps {
		namespaced["ConfigMap "+o.Name] = o.Namespace
	}
	for _, o := range m.secrets {
		namespaced["Secret "+o.Name] = o.Namespace
	}
	for _, o := range m.roles {
		namespaced["Role "+o.Name] = o.Namespace
	}
	for _, o := range m.roleBindings {
		namespaced["RoleBinding "+o.Name] = o.Namespace
	}
	for _, o := range m.services {
		namespaced["Service "+o.Name] = o.Namespace
	}
	for _, o := range m.budgets {
		namespaced["PodDisruptionBudget "+o.Name] = o.Namespace
	}
	for _, p := range m.pods() {
		namespaced[p.what] = p.namespace
	}
	for what, ns := range namespaced {
		if !namespaces[ns] {
			t.Errorf("%s: %s is in namespace %q, which no Namespace of the manifests makes", d.what, what, ns)
		}
	}

	if len(m.deployments) != 1 || len(m.daemonSets) != 1 {
		t.Fatalf("%s: %d Deployments and %d DaemonSets, want the controller and the node plugin", d.what, len(m.deployments), len(m.daemonSets))
	}
	ps := m.pods()
	controller, node := ps[0], ps[1] // pods lists the Deployments first

	for _, p := range []pod{controller, node} {
		checkPodVolumes(t, m, p, d.externalSecret)
		checkServiceAccount(t, m, p)
		checkSocket(t, p)
		checkImages(t, p)
		checkDriverArgs(t, p)
		checkResources(t, p)
		checkProbesAndPorts(t, p)
		checkMetrics(t, m, p, d.metrics)
	}
	checkConfig(t, m, controller, node, d)

	// The driver's mode in each.
	if mode, _ := flag(driverContainer(t, controller).Args, "mode"); mode != "controller" {
		t.Errorf("%s: rnbd-csi --mode=%q, want controller", controller.what, mode)
	}
	if mode, _ := flag(driverContainer(t, node).Args, "mode"); mode != "node" {
		t.Errorf("%s: rnbd-csi --mode=%q, want node", node.what, mode)
	}

	// The controller's sidecars are the standard ones, each electing a
	// leader, and its ServiceAccount may hold the leases they elect with.
	wantSidecars := []string{"csi-provisioner", "csi-attacher", "csi-resizer", "csi-snapshotter", "livenessprobe"}
	checkSidecars(t, controller, wantSidecars)
	for _, c := range controller.spec.Containers {
		if !strings.HasPrefix(c.Image, "registry.k8s.io/sig-storage/csi-") {
			continue
		}
		if !slices.Contains(c.Args, "--leader-election") {
			t.Errorf("%s: %s has no --leader-election", controller.what, c.Name)
		}
		ns, ok := flag(c.Args, "leader-election-namespace")
		if !ok {
			t.Errorf("%s: %s has no --leader-election-namespace", controller.what, c.Name)
		} else if ns == "$(NAMESPACE)" {
			ns = controller.namespace
		}
		if ok && !mayInNamespace(m, controller.namespace, controller.spec.ServiceAccountName, ns, "coordination.k8s.io", "leases", "create", "update", "get") {
			t.Errorf("%s: service account %s may not create, update and get leases in %q, where %s elects its leader", controller.what, controller.spec.ServiceAccountName, ns, c.Name)
		}
	}
	checkControllerSecurity(t, controller)
	checkControllerReplicas(t, m, controller, d.ha)
	checkCapacity(t, m, controller, d.capacity)

	// The node plugin: registered with the kubelet under the driver's name,
	// its socket where the kubelet looks for it, the kubelet's directory
	// mounted Bidirectional in a privileged container.
	checkSidecars(t, node, []string{"csi-node-driver-registrar", "livenessprobe"})
	checkNodeSecurity(t, node)
	kubeletDir := d.kubeletDir
	pluginDir := kubeletDir + "/plugins/" + driver
	nodeDriver := driverContainer(t, node)
	endpoint, _ := flag(nodeDriver.Args, "endpoint")
	sock := strings.TrimPrefix(endpoint, "unix://")
	if vm := mountOf(nodeDriver, sock); vm != nil {
		v := volumeNamed(node, vm.Name)
		if v == nil || v.HostPath == nil || path.Clean(v.HostPath.Path) != pluginDir {
			t.Errorf("%s: the CSI socket %s is not on a hostPath volume of %s/", node.what, sock, pluginDir)
		}
	}
	registered := false
	for _, c := range node.spec.Containers {
		if !strings.Contains(c.Image, "/csi-node-driver-registrar:") {
			continue
		}
		registered = true
		want := pluginDir + "/" + path.Base(sock)
		if got, _ := flag(c.Args, "kubelet-registration-path"); got != want {
			t.Errorf("%s: %s --kubelet-registration-path=%q, want %q (the driver's socket as the kubelet sees it)", node.what, c.Name, got, want)
		}
		vm := mountOf(&c, "/registration")
		if vm == nil {
			t.Errorf("%s: %s does not mount /registration", node.what, c.Name)
		} else if v := volumeNamed(node, vm.Name); v == nil || v.HostPath == nil || path.Clean(v.HostPath.Path) != kubeletDir+"/plugins_registry" {
			t.Errorf("%s: %s's /registration is not the kubelet's %s/plugins_registry/", node.what, c.Name, kubeletDir)
		}
	}
	if !registered {
		t.Errorf("%s has no node-driver-registrar", node.what)
	}
	kubelet := mountOf(nodeDriver, kubeletDir+"/pods")
	switch {
	case kubelet == nil || path.Clean(kubelet.MountPath) != kubeletDir:
		t.Errorf("%s: rnbd-csi does not mount %s at the same path (the kubelet passes host paths)", node.what, kubeletDir)
	case kubelet.MountPropagation == nil || *kubelet.MountPropagation != corev1.MountPropagationBidirectional:
		t.Errorf("%s: rnbd-csi's %s is not Bidirectional: the kubelet would not see its mounts", node.what, kubeletDir)
	default:
		if v := volumeNamed(node, kubelet.Name); v == nil || v.HostPath == nil || path.Clean(v.HostPath.Path) != kubeletDir {
			t.Errorf("%s: rnbd-csi's %s is not the host's", node.what, kubeletDir)
		}
	}
	// Every other hostPath is the driver's socket, the registration
	// directory, /dev or the client daemon's (checkConfig): none is under
	// another kubelet directory than this one.
	for _, v := range node.spec.Volumes {
		if v.HostPath != nil && strings.Contains(v.HostPath.Path, "kubelet") && !strings.HasPrefix(path.Clean(v.HostPath.Path), kubeletDir) {
			t.Errorf("%s: volume %s is the host's %s, not under the kubelet's directory %s", node.what, v.Name, v.HostPath.Path, kubeletDir)
		}
	}
	sc := nodeDriver.SecurityContext
	if sc == nil || sc.Privileged == nil || !*sc.Privileged {
		t.Errorf("%s: rnbd-csi is not privileged (Bidirectional propagation and the host's block devices need it)", node.what)
	}
	// The host's /dev (the client daemon's directory: checkConfig).
	if vm := mountOf(nodeDriver, "/dev"); vm == nil || path.Clean(vm.MountPath) != "/dev" {
		t.Errorf("%s: rnbd-csi does not mount the host's /dev", node.what)
	} else if v := volumeNamed(node, vm.Name); v == nil || v.HostPath == nil || path.Clean(v.HostPath.Path) != "/dev" {
		t.Errorf("%s: rnbd-csi's /dev is not the host's", node.what)
	}
	if node.spec.HostNetwork || node.spec.HostPID {
		t.Errorf("%s: hostNetwork %v, hostPID %v: the plugin needs neither", node.what, node.spec.HostNetwork, node.spec.HostPID)
	}
	// Any other propagation than the kubelet directory's is a mistake.
	for _, p := range []pod{controller, node} {
		for _, c := range p.spec.Containers {
			for _, vm := range c.VolumeMounts {
				if vm.MountPropagation == nil || *vm.MountPropagation == corev1.MountPropagationNone {
					continue
				}
				if p.what != node.what || c.Name != nodeDriver.Name || path.Clean(vm.MountPath) != kubeletDir {
					t.Errorf("%s: %s mounts %s with propagation %s; only the node plugin's %s should propagate", p.what, c.Name, vm.MountPath, *vm.MountPropagation, kubeletDir)
				}
			}
		}
	}
}

// checkPodVolumes: every volumeMount names a volume of its pod, every
// volume is mounted, and the Secrets and ConfigMaps the volumes come from
// are in the manifests, in the pod's namespace, with the keys mounted;
// but for the Secret externalSecret, which is made outside them.
func checkPodVolumes(t *testing.T, m *manifests, p pod, externalSecret string) {
	t.Helper()
	used := map[string]bool{}
	for _, c := range slices.Concat(p.spec.InitContainers, p.spec.Containers) {
		for _, vm := range c.VolumeMounts {
			used[vm.Name] = true
			v := volumeNamed(p, vm.Name)
			if v == nil {
				t.Errorf("%s: container %s mounts volume %q, which the pod does not have", p.what, c.Name, vm.Name)
				continue
			}
			if vm.SubPath == "" {
				continue
			}
			var keys []string
			switch {
			case v.ConfigMap != nil:
				for _, cm := range m.configMaps {
					if cm.Name == v.ConfigMap.Name {
						keys = slices.Collect(mapKeys(cm.Data))
					}
				}
			case v.Secret != nil:
				for _, s := range m.secrets {
					if s.Name == v.Secret.SecretName {
						keys = slices.Concat(slices.Collect(mapKeys(s.StringData)), slices.Collect(mapKeys(bytesKeys(s.Data))))
					}
				}
			default:
				continue
			}
			if !slices.Contains(keys, vm.SubPath) {
				t.Errorf("%s: container %s mounts %s from volume %s's key %q, which it does not have (it has %v)", p.what, c.Name, vm.MountPath, vm.Name, vm.SubPath, keys)
			}
		}
	}
	for _, v := range p.spec.Volumes {
		if !used[v.Name] {
			t.Errorf("%s: volume %s is mounted by no container", p.what, v.Name)
		}
		if v.Secret != nil && v.Secret.SecretName != externalSecret && !slices.ContainsFunc(m.secrets, func(s *corev1.Secret) bool {
			return s.Name == v.Secret.SecretName && s.Namespace == p.namespace
		}) {
			t.Errorf("%s: volume %s is the Secret %s, which the Secret layout (deploy/kubernetes/examples) does not have in namespace %s", p.what, v.Name, v.Secret.SecretName, p.namespace)
		}
		if v.ConfigMap != nil && !slices.ContainsFunc(m.configMaps, func(c *corev1.ConfigMap) bool {
			return c.Name == v.ConfigMap.Name && c.Namespace == p.namespace
		}) {
			t.Errorf("%s: volume %s is the ConfigMap %s, which the manifests do not have in namespace %s", p.what, v.Name, v.ConfigMap.Name, p.namespace)
		}
	}
	// Every $(VAR) in a container's arguments is one of its env.
	ref := regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)
	for _, c := range p.spec.Containers {
		for _, a := range c.Args {
			for _, sm := range ref.FindAllStringSubmatch(a, -1) {
				if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == sm[1] }) {
					t.Errorf("%s: container %s's argument %q names $(%s), which its env does not set", p.what, c.Name, a, sm[1])
				}
			}
		}
	}
}

func bytesKeys(m map[string][]byte) map[string]string {
	r := make(map[string]string, len(m))
	for k := range m {
		r[k] = ""
	}
	return r
}

func mapKeys(m map[string]string) func(func(string) bool) {
	return func(yield func(string) bool) {
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			if !yield(k) {
				return
			}
		}
	}
}

// checkServiceAccount: the pod's ServiceAccount is in the manifests and
// bound to a role that is.
func checkServiceAccount(t *testing.T, m *manifests, p pod) {
	t.Helper()
	sa := p.spec.ServiceAccountName
	if sa == "" {
		t.Errorf("%s names no serviceAccountName", p.what)
		return
	}
	if !slices.ContainsFunc(m.serviceAccounts, func(s *corev1.ServiceAccount) bool { return s.Name == sa && s.Namespace == p.namespace }) {
		t.Errorf("%s: service account %s/%s is not in the manifests", p.what, p.namespace, sa)
	}
	bound := false
	for _, b := range m.clusterBindings {
		if hasSubject(b.Subjects, p.namespace, sa) {
			bound = true
			if b.RoleRef.Kind != "ClusterRole" || clusterRole(m, b.RoleRef.Name) == nil {
				t.Errorf("ClusterRoleBinding %s binds %s to %s %s, which the manifests do not have", b.Name, sa, b.RoleRef.Kind, b.RoleRef.Name)
			}
		}
	}
	for _, b := range m.roleBindings {
		if hasSubject(b.Subjects, p.namespace, sa) {
			bound = true
			if (b.RoleRef.Kind == "Role" && role(m, b.Namespace, b.RoleRef.Name) == nil) || (b.RoleRef.Kind == "ClusterRole" && clusterRole(m, b.RoleRef.Name) == nil) {
				t.Errorf("RoleBinding %s/%s binds %s to %s %s, which the manifests do not have", b.Namespace, b.Name, sa, b.RoleRef.Kind, b.RoleRef.Name)
			}
		}
	}
	if !bound {
		t.Errorf("%s: service account %s/%s is bound by no ClusterRoleBinding or RoleBinding", p.what, p.namespace, sa)
	}
	for _, b := range m.clusterBindings {
		for _, s := range b.Subjects {
			if s.Kind == "ServiceAccount" && !slices.ContainsFunc(m.serviceAccounts, func(a *corev1.ServiceAccount) bool { return a.Name == s.Name && a.Namespace == s.Namespace }) {
				t.Errorf("ClusterRoleBinding %s binds service account %s/%s, which the manifests do not have", b.Name, s.Namespace, s.Name)
			}
		}
	}
}

func hasSubject(subjects []rbacv1.Subject, namespace, sa string) bool {
	return slices.ContainsFunc(subjects, func(s rbacv1.Subject) bool {
		return s.Kind == "ServiceAccount" && s.Name == sa && s.Namespace == namespace
	})
}

func clusterRole(m *manifests, name string) *rbacv1.ClusterRole {
	for _, r := range m.clusterRoles {
		if r.Name == name {
			return r
		}
	}
	return nil
}

func role(m *manifests, namespace, name string) *rbacv1.Role {
	for _, r := range m.roles {
		if r.Name == name && r.Namespace == namespace {
			return r
		}
	}
	return nil
}

// mayInNamespace: a binding of the manifests gives service account
// saNamespace/sa every one of verbs on group/resource in namespace ns.
func mayInNamespace(m *manifests, saNamespace, sa, ns, group, resource string, verbs ...string) bool {
	var rules []rbacv1.PolicyRule
	for _, b := range m.clusterBindings {
		if hasSubject(b.Subjects, saNamespace, sa) {
			if r := clusterRole(m, b.RoleRef.Name); r != nil {
				rules = append(rules, r.Rules...)
			}
		}
	}
	for _, b := range m.roleBindings {
		if b.Namespace != ns || !hasSubject(b.Subjects, saNamespace, sa) {
			continue
		}
		if b.RoleRef.Kind == "Role" {
			if r := role(m, ns, b.RoleRef.Name); r != nil {
				rules = append(rules, r.Rules...)
			}
		} else if r := clusterRole(m, b.RoleRef.Name); r != nil {
			rules = append(rules, r.Rules...)
		}
	}
	for _, v := range verbs {
		if !slices.ContainsFunc(rules, func(r rbacv1.PolicyRule) bool {
			return slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) && slices.Contains(r.Verbs, v)
		}) {
			return false
		}
	}
	return true
}

// checkSocket: the driver listens where every sidecar of its pod
// connects, on a volume they share.
func checkSocket(t *testing.T, p pod) {
	t.Helper()
	d := driverContainer(t, p)
	endpoint, _ := flag(d.Args, "endpoint")
	sock, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok || !path.IsAbs(sock) {
		t.Errorf("%s: rnbd-csi --endpoint=%q, want unix:///ABSOLUTE/PATH", p.what, endpoint)
		return
	}
	dm := mountOf(d, sock)
	if dm == nil {
		t.Errorf("%s: rnbd-csi's socket %s is on no volume the sidecars could share", p.what, sock)
		return
	}
	for _, c := range p.spec.Containers {
		if c.Name == d.Name {
			continue
		}
		addr, ok := flag(c.Args, "csi-address")
		if !ok {
			t.Errorf("%s: sidecar %s has no --csi-address", p.what, c.Name)
			continue
		}
		if addr != sock {
			t.Errorf("%s: sidecar %s --csi-address=%q, but rnbd-csi listens on %q", p.what, c.Name, addr, sock)
			continue
		}
		if cm := mountOf(&c, addr); cm == nil || cm.Name != dm.Name || path.Clean(cm.MountPath) != path.Clean(dm.MountPath) {
			t.Errorf("%s: sidecar %s does not mount volume %s at %s, where rnbd-csi's socket is", p.what, c.Name, dm.Name, dm.MountPath)
		}
	}
}

// pinnedSidecar is an image of kubernetes-csi's sidecars at a release tag.
var pinnedSidecar = regexp.MustCompile(`^registry\.k8s\.io/sig-storage/[a-z-]+:v[0-9]+\.[0-9]+\.[0-9]+$`)

// checkImages: every sidecar is an official image pinned to a release.
func checkImages(t *testing.T, p pod) {
	t.Helper()
	d := driverContainer(t, p)
	for _, c := range p.spec.Containers {
		if c.Name != d.Name && !pinnedSidecar.MatchString(c.Image) {
			t.Errorf("%s: sidecar %s's image %q is not registry.k8s.io/sig-storage/NAME:vX.Y.Z", p.what, c.Name, c.Image)
		}
	}
}

// checkSidecars: the pod runs exactly these sidecars (by image name).
func checkSidecars(t *testing.T, p pod, want []string) {
	t.Helper()
	d := driverContainer(t, p)
	var got []string
	for _, c := range p.spec.Containers {
		if c.Name == d.Name {
			continue
		}
		name, _, _ := strings.Cut(path.Base(c.Image), ":")
		got = append(got, name)
	}
	if !slices.Equal(got, want) {
		t.Errorf("%s runs sidecars %v, want %v", p.what, got, want)
	}
}

// The StorageClass parameters the examples use are those
// docs/kubernetes.md describes, with values it allows (the chart's
// StorageClasses: TestHelmChart).
func TestKubernetesStorageClassParameters(t *testing.T) {
	checkStorageClassParameters(t, loadManifests(t))
}

func checkStorageClassParameters(t *testing.T, m *manifests) {
	t.Helper()
	doc, err := os.ReadFile("../../docs/kubernetes.md")
	if err != nil {
		t.Fatal(err)
	}
	// The rows of the section's table: | `name` | values | ...
	_, section, ok := strings.Cut(string(doc), "\n## StorageClass parameters\n")
	if !ok {
		t.Fatal("docs/kubernetes.md has no section StorageClass parameters")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	row := regexp.MustCompile("(?m)^\\| `([A-Za-z0-9./-]+)` \\| ([^|]*)\\|")
	allowed := map[string]string{}
	for _, r := range row.FindAllStringSubmatch(section, -1) {
		allowed[r[1]] = r[2]
	}
	if len(allowed) == 0 {
		t.Fatal("docs/kubernetes.md has no StorageClass parameters table")
	}
	literal := regexp.MustCompile("`([^`]*)`")
	for _, sc := range m.storageClasses {
		for k, v := range sc.Parameters {
			values, ok := allowed[k]
			if !ok {
				t.Errorf("StorageClass %s: parameter %q is not in docs/kubernetes.md's table", sc.Name, k)
				continue
			}
			var enum []string
			for _, l := range literal.FindAllStringSubmatch(values, -1) {
				enum = append(enum, l[1])
			}
			if len(enum) > 0 && !slices.Contains(enum, v) {
				t.Errorf("StorageClass %s: %s: %q, docs/kubernetes.md allows %v", sc.Name, k, v, enum)
			}
		}
	}
}
