package lint

import (
	"bytes"
	stdflag "flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// The Helm chart deploy/helm/rnbd-csi, rendered by `helm template` with
// the helm the Makefile pins (HELM_VERSION) and builds into bin/tools, as
// make test does before it runs the tests. Each rendering is decoded
// strictly and checked as deploy/kubernetes is (checkDeployment), and
// deploy/kubernetes is the rendering with the default values.

var update = stdflag.Bool("update", false, "TestHelmDefaultsArePlainManifests: write deploy/kubernetes from the chart's default rendering (make manifests)")

const (
	chartDir    = "../../deploy/helm/rnbd-csi"
	releaseName = "rnbd-csi"
	// generatedHeader opens each file of deploy/kubernetes the chart makes.
	generatedHeader = `# Made by make manifests from the Helm chart deploy/helm/rnbd-csi with its
# default values, released as rnbd-csi in the namespace rnbd-csi: change
# the chart (its templates and values.yaml), not this file. test/lint's
# TestHelmDefaultsArePlainManifests holds the two alike.
`
)

// handWritten are the files of deploy/kubernetes that are not the chart's:
// the namespace, which a Helm release is installed into, not made by it.
var handWritten = []string{"namespace.yaml"}

// helmBinary is the pinned helm: RNBD_HELM (make test sets it), else
// bin/tools/helm-HELM_VERSION if it was built. Outside make without it,
// the test skips, saying how to have it: building helm takes minutes
// (docs/testing.md), too long to start from a test unasked.
func helmBinary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("RNBD_HELM"); p != "" {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("RNBD_HELM=%s: %v", p, err)
		}
		return p
	}
	version := makefileVar(t, "HELM_VERSION")
	p, err := filepath.Abs("../../bin/tools/helm-" + version)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); err != nil {
		t.Skipf("helm %s is not built: make test builds it into bin/tools first (make helm builds it alone), or RNBD_HELM=/path/to/helm names one", version)
	}
	return p
}

// makefileVar is the value of NAME := VALUE in the Makefile.
func makefileVar(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\s*:=\s*(\S+)\s*$`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("the Makefile sets no %s", name)
	}
	return string(m[1])
}

// helmTemplate renders the chart as the release rnbd-csi in namespace,
// with helm's further arguments; the error has what helm said.
func helmTemplate(t *testing.T, namespace string, args ...string) (string, error) {
	t.Helper()
	return helm(t, append([]string{"template", releaseName, chartDir, "--namespace", namespace}, args...)...)
}

// helm runs the pinned helm with args, and says what it printed.
func helm(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(helmBinary(t), args...)
	// Nothing of the user's helm configuration, caches or plugins.
	home := t.TempDir()
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+home+"/cache", "HELM_CONFIG_HOME="+home+"/config", "HELM_DATA_HOME="+home+"/data")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("helm %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()+"\n"+stdout.String()))
	}
	return stdout.String(), nil
}

// sourceLine opens each document helm renders: the template it comes from.
var sourceLine = regexp.MustCompile(`^# Source: rnbd-csi/templates/([^/\n]+\.yaml)\n`)

// renderedFiles groups a rendering's documents by their template, in the
// order helm gives them, each document as helm wrote it with its
// separator: the files of deploy/kubernetes the chart makes.
func renderedFiles(t *testing.T, out string) (map[string]string, []string) {
	t.Helper()
	files := map[string]string{}
	var order []string
	for _, doc := range docSeparator.Split(out, -1) {
		doc = strings.TrimLeft(doc, "\n")
		if strings.TrimSpace(doc) == "" {
			continue
		}
		m := sourceLine.FindStringSubmatch(doc)
		if m == nil {
			t.Fatalf("a rendered document does not start with its # Source line:\n%s", doc)
		}
		if _, ok := files[m[1]]; !ok {
			order = append(order, m[1])
		}
		files[m[1]] += "---\n" + strings.TrimRight(doc, "\n") + "\n"
	}
	return files, order
}

// chartValues are the values the checks depend on, as a rendering sees
// them: values.yaml with a values file over it.
type chartValues struct {
	DriverName   string `json:"driverName"`
	KubeletDir   string `json:"kubeletDir"`
	Certificates struct {
		SecretName string `json:"secretName"`
		Cert       string `json:"cert"`
		Key        string `json:"key"`
		CA         string `json:"ca"`
	} `json:"certificates"`
	StorageCapacity bool `json:"storageCapacity"`
	Metrics         struct {
		Enabled bool `json:"enabled"`
	} `json:"metrics"`
	Controller struct {
		Replicas            int `json:"replicas"`
		PodDisruptionBudget struct {
			Enabled bool `json:"enabled"`
		} `json:"podDisruptionBudget"`
	} `json:"controller"`
}

func readValues(t *testing.T, files ...string) chartValues {
	t.Helper()
	var v chartValues
	for _, f := range append([]string{filepath.Join(chartDir, "values.yaml")}, files...) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		// Over what is there: a key the file has not keeps its value.
		if err := yaml.Unmarshal(b, &v); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
	}
	return v
}

// defaultKubeletDir is a path under the kubelet's usual directory (not
// under another that ends as it does, microk8s's).
var defaultKubeletDir = regexp.MustCompile(`(^|[^/\w.-])/var/lib/kubelet[^\s]*`)

// TestHelmChart: the chart passes helm lint --strict and renders with its
// default values and with each values file of its ci/ directory (other kubelet directories, the
// certificate as PEM, StorageClasses, one replica, no metrics, no storage
// capacity tracking, ...); every object of each rendering decodes strictly
// into its Kubernetes type, and the whole passes the checks the plain
// manifests pass, with what those values ask for: the kubelet directory
// in every path, the driver's name, the Secret made or not.
func TestHelmChart(t *testing.T) {
	helmBinary(t) // or skip, once
	ci, err := filepath.Glob(filepath.Join(chartDir, "ci", "*-values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(ci) < 2 {
		t.Fatalf("%d values files in %s/ci, want the two that render it far from its defaults", len(ci), chartDir)
	}
	for _, file := range append([]string{""}, ci...) {
		name, namespace, args := "default values", "rnbd-csi", []string(nil)
		var files []string
		if file != "" {
			name, namespace, args, files = "ci/"+filepath.Base(file), "storage-system", []string{"--values", file}, []string{file}
		}
		t.Run(name, func(t *testing.T) {
			if _, err := helm(t, append([]string{"lint", "--strict", chartDir}, args...)...); err != nil {
				t.Error(err)
			}
			out, err := helmTemplate(t, namespace, args...)
			if err != nil {
				t.Fatal(err)
			}
			m := &manifests{}
			m.decode(t, "the chart with "+name, out)
			if t.Failed() {
				t.FailNow()
			}
			v := readValues(t, files...)
			d := deployment{
				what:       "the chart with " + name,
				namespace:  namespace,
				driver:     v.DriverName,
				kubeletDir: filepath.Clean(v.KubeletDir),
				ha:         v.Controller.Replicas > 1 && v.Controller.PodDisruptionBudget.Enabled,
				metrics:    v.Metrics.Enabled,
				capacity:   v.StorageCapacity,
			}
			c := v.Certificates
			if c.Cert == "" {
				d.externalSecret = c.SecretName
			} else if len(m.secrets) != 1 || m.secrets[0].Name != c.SecretName {
				t.Errorf("%s: the certificate is given as PEM, but the chart made no Secret %s", d.what, c.SecretName)
			}
			checkDeployment(t, m, d)
			checkStorageClassParameters(t, m)
			if d.kubeletDir != "/var/lib/kubelet" && defaultKubeletDir.MatchString(out) {
				t.Errorf("%s: kubeletDir is %s, but the rendering names /var/lib/kubelet: %q", d.what, d.kubeletDir, defaultKubeletDir.FindString(out))
			}
		})
	}
}

// TestHelmDefaultsArePlainManifests: each file of deploy/kubernetes but
// the namespace is the chart's rendering with its default values of the
// template of the same name, as it is; -update (make manifests) writes
// them so and removes those the chart no longer makes.
func TestHelmDefaultsArePlainManifests(t *testing.T) {
	helmBinary(t) // or skip, once
	out, err := helmTemplate(t, "rnbd-csi")
	if err != nil {
		t.Fatal(err)
	}
	files, order := renderedFiles(t, out)
	dir := "../../deploy/kubernetes"
	existing, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range order {
		if slices.Contains(handWritten, name) {
			t.Fatalf("the chart's template %s has the name of a hand-written file of deploy/kubernetes", name)
		}
		want := generatedHeader + files[name]
		file := filepath.Join(dir, name)
		if *update {
			if err := os.WriteFile(file, []byte(want), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(file)
		if err != nil {
			t.Errorf("deploy/kubernetes/%s: %v: the chart renders it (make manifests writes it)", name, err)
			continue
		}
		if string(got) != want {
			t.Errorf("deploy/kubernetes/%s is not the chart's default rendering: make manifests writes it (%s)", name, firstDifference(string(got), want))
		}
	}
	for _, file := range existing {
		name := filepath.Base(file)
		if _, ok := files[name]; ok || slices.Contains(handWritten, name) {
			continue
		}
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case !strings.HasPrefix(string(b), generatedHeader):
			t.Errorf("deploy/kubernetes/%s is neither the chart's nor one of the hand-written %v", name, handWritten)
		case *update:
			if err := os.Remove(file); err != nil {
				t.Fatal(err)
			}
		default:
			t.Errorf("deploy/kubernetes/%s was the chart's, which no longer renders it: make manifests removes it", name)
		}
	}
}

// firstDifference says where got and want first differ, by line.
func firstDifference(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; i < len(g) || i < len(w); i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl != wl {
			return fmt.Sprintf("line %d is %q, the chart's %q", i+1, gl, wl)
		}
	}
	return "they differ"
}

// TestHelmChartRefusesBadValues: values that would deploy something that
// cannot work fail the rendering, saying which value and what to give; a
// misspelt key is one (values.schema.json), not a silent default.
func TestHelmChartRefusesBadValues(t *testing.T) {
	helmBinary(t) // or skip, once
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--set", "kubeletdir=/var/lib/k0s/kubelet"}, "additional properties 'kubeletdir' not allowed"},
		{[]string{"--set", "kubeletDir=var/lib/kubelet"}, "/kubeletDir"},
		{[]string{"--set", "storageNodes=null"}, "storageNodes: give at least one storage node"},
		{[]string{"--set-json", `storageNodes=[{"name":"a","admin":"http://10.0.0.1:1235","paths":["ip:10.0.0.1"],"pool":"p"}]`}, "/storageNodes/0/admin"},
		{[]string{"--set-json", `storageNodes=[{"name":"a","admin":"https://10.0.0.1:1235","paths":["10.0.0.1"],"pool":"p"}]`}, "/storageNodes/0/paths/0"},
		{[]string{"--set", "certificates.cert=PEM"}, "certificates: give cert, key and ca together"},
		{[]string{"--set", "ports.metrics=9808"}, "ports: healthz and metrics are both 9808"},
		{[]string{"--set", "logLevel=trace"}, "/logLevel"},
		{[]string{"--set", "controller.runAsUser=0"}, "/controller/runAsUser"},
		{[]string{"--set", "config.clientSocket=/client.sock"}, "config.clientSocket \"/client.sock\": want it in a directory of its own"},
		{[]string{"--set", "images.rnbdCSI.pullPolicy=Sometimes"}, "/images/rnbdCSI/pullPolicy"},
		{[]string{"--set", "config.workers.source=kubelet"}, "/config/workers/source"},
	} {
		_, err := helmTemplate(t, "rnbd-csi", tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("helm template %v: %v, want an error with %q", tc.args, err, tc.want)
		}
	}
}
