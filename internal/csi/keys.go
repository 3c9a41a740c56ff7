package csi

import "github.com/rnbd/rnbd/internal/conf"

// ConfigKeys is the reference of /etc/rnbd/csi.toml: docs/kubernetes.md's
// table and rnbd-csi.toml(5) are made from it (TestConfigKeysDoc holds it
// to Config and the docs; cmd/rnbd-csi's test to the page).
var ConfigKeys = []conf.KeyDoc{
	{Keys: []string{"version"}, Default: "1",
		Doc: "the file's format; a file of a newer version than the driver understands is refused"},
	{Keys: []string{"driver_name"}, Default: "`" + DefaultDriverName + "`",
		Doc: "the CSI driver's name (GetPluginInfo): what the CSIDriver object and a StorageClass's `provisioner` name; at most 63 of letters, digits, `.` and `-`, starting and ending with a letter or digit"},
	{Table: "[[storage_node]]", Keys: []string{"name"}, Default: "required",
		Doc: "one table per storage node (an rnbd-server with an `[admin]` listener) the controller places volumes on; its name is the first part of the volume ids of its volumes (`NAME/VOLUME`), so it never changes: 1 to 63 of letters, digits, `.`, `_` and `-`"},
	{Table: "[[storage_node]]", Keys: []string{"admin"}, Default: "required",
		Doc: "its admin listener, `https://HOST:PORT` (its `[admin] listen`)"},
	{Table: "[[storage_node]]", Keys: []string{"paths"}, Default: "required",
		Doc: "the fabric addresses workers map its volumes through, `ip:ADDRESS` (or `gid:GID`), one per path of a multipath session; a StorageClass's `paths` picks among them"},
	{Table: "[[storage_node]]", Keys: []string{"port"}, Default: "1234",
		Doc: "its fabric port (its `listen` addresses' port)"},
	{Table: "[[storage_node]]", Keys: []string{"pool"}, Default: "required",
		Doc: "the pool volumes go to where a StorageClass names none"},
	{Table: "[[storage_node]]", Keys: []string{"labels"}, Default: "none",
		Doc: "its topology, a value per topology key (`{ \"topology.kubernetes.io/zone\" = \"zone-a\" }`): a volume on it is accessible from the workers with the same labels. With labels on any storage node the driver advertises volume accessibility constraints"},
	{Table: "[tls]", Keys: []string{"cert", "key", "ca"}, Default: "unset",
		Doc: "the controller's certificate (a name `[admin] provisioners` lists on every storage node), its key, and the authority of the storage nodes' admin certificates; the controller needs all three, the node plugin none"},
	{Table: "[tls]", Keys: []string{"server_name"}, Default: "the host of `admin`",
		Doc: "the name every storage node's admin certificate must have; unset, it must name the host of its `admin` address"},
	{Table: "[node]", Keys: []string{"client_socket"}, Default: "`" + DefaultClientSocket + "`",
		Doc: "the control socket of the worker's rnbd-client daemon, which maps the volumes (the node plugin's)"},
	{Table: "[node]", Keys: []string{"node_id"}, Flag: "`--node-id`", Default: "required (node plugin)",
		Doc: "the worker's identity: a name of the certificate its rnbd-client presents to the storage nodes, which a publish grants the volume to. One file serves every worker: leave it out and give `--node-id` (in Kubernetes, the node's name)"},
	{Table: "[node]", Keys: []string{"labels"}, Default: "none",
		Doc: "the worker's topology (NodeGetInfo), the same keys as the storage nodes' `labels`, where it is the same on every worker the file reaches"},
	{Table: "[node]", Keys: []string{"topology_from_node"}, Default: "none",
		Doc: "topology keys whose values are read from the labels of the worker's Kubernetes Node, named by its node id, at each NodeGetInfo: `[\"topology.kubernetes.io/zone\"]` lets one ConfigMap serve workers in every zone (the node plugin's service account gets Nodes). A key the Node has not is left out, with a warning: that worker can use no volume of a storage node labelled with it. A key may not be in `labels` too"},
	{Table: "[workers]", Keys: []string{"source"}, Default: "`kubernetes`",
		Doc: "how the controller knows the workers a volume may be published to: `kubernetes`, the CSINode objects that register the driver with that node id (node-driver-registrar writes them from NodeGetInfo), listed with the controller's service account; `list`, the node ids in `names`; `any`, no check. A publish to a node id that is not a worker's is refused NotFound, not granted"},
	{Table: "[workers]", Keys: []string{"names"}, Default: "none",
		Doc: "the workers' node ids, for `source = \"list\"` (CSI without Kubernetes)"},
	{Table: "[controller]", Keys: []string{"storage_timeout"}, Default: "5s",
		Doc: "how long one call of the controller to a storage node may take; a node that does not answer within it is left out of that call (placement, listing, capacity: the nodes that answer serve it), and a call that needs that node fails Unavailable, which the CO retries"},
	{Table: "[controller]", Keys: []string{"max_calls_per_node", "max_queued_per_node"}, Default: "16, 512",
		Doc: "calls the controller has under way to one storage node at once, and how many more wait their turn (the wait is `rnbd_csi_storage_queue_wait_seconds`); one past both is refused Unavailable at once. Keep `max_calls_per_node` under the storage nodes' `[admin] max_requests_per_identity`"},
	{Table: "[controller]", Keys: []string{"reconcile_interval"}, Default: "1m0s",
		Doc: "how often the controller lists the storage nodes for the copies of one CSI name on two nodes (made while one did not answer) and reclaims the older ([kubernetes.md](kubernetes.md#a-storage-node-that-does-not-answer)); a node that answers again is looked at at once"},
	{Table: "[kubernetes]", Keys: []string{"api_server", "token_file", "ca"}, Default: "the pod's own",
		Doc: "the Kubernetes API server (`https://HOST:PORT`; unset, `KUBERNETES_SERVICE_HOST` and `_PORT`), the bearer token's file and the API server's authority (unset, the service account's), for `[workers] source = \"kubernetes\"` and `topology_from_node`; the token is read again at each call, as Kubernetes rotates it"},
}
