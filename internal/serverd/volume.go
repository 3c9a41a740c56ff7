// Pools and volumes: the [[pool]] tables, the volumes made in them by
// name, each exported under its name (docs/server.md, "Pools and
// volumes").

package serverd

import (
	"fmt"

	"github.com/rnbd/rnbd/internal/pool"
)

// PoolConfig is a [[pool]] table.
type PoolConfig struct {
	Name string `toml:"name"`
	// Type is "dir" (sparse files under Path) or "lvm-thin" (thin
	// volumes of ThinPool in VolumeGroup).
	Type        string `toml:"type"`
	Path        string `toml:"path"`
	VolumeGroup string `toml:"volume_group"`
	ThinPool    string `toml:"thin_pool"`
}

// validate checks a [[pool]] table's keys (not that its directory or
// volume group is there: that is found at start, and a pool that is not
// there is not served until it is).
func (c PoolConfig) validate() error {
	if err := pool.CheckName(c.Name); err != nil {
		return fmt.Errorf("[[pool]] %q: %v", c.Name, err)
	}
	switch c.Type {
	case "dir":
		if c.Path == "" || c.VolumeGroup != "" || c.ThinPool != "" {
			return fmt.Errorf("[[pool]] %s: type dir takes path (and not volume_group nor thin_pool)", c.Name)
		}
	case "lvm-thin":
		if c.Path != "" || c.VolumeGroup == "" || c.ThinPool == "" {
			return fmt.Errorf("[[pool]] %s: type lvm-thin takes volume_group and thin_pool (and not path)", c.Name)
		}
	default:
		return fmt.Errorf("[[pool]] %s: type %q: want dir or lvm-thin", c.Name, c.Type)
	}
	return nil
}
