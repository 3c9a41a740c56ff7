// Package conf is what both daemons' configuration and state files
// share: TOML loading that refuses unknown keys, durations as people
// write them (sizes are units.Size), and atomic file replacement.
package conf

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/BurntSushi/toml"
)

// Duration is a time.Duration written as "5s" in a file.
type Duration struct{ time.Duration }

func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return err
	}
	d.Duration = v
	return nil
}

func (d Duration) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// Meta is what LoadTOML saw of a file beyond its values.
type Meta struct {
	// Found: the file exists (a missing default file is no error).
	Found bool
	md    toml.MetaData
}

// Defined reports whether the file has key (a table: "tls").
func (m Meta) Defined(key ...string) bool { return m.Found && m.md.IsDefined(key...) }

// LoadTOML decodes path over v (which holds the defaults and a Version
// field at most newest). A missing file is fine unless mustExist. A key
// or table v has no field for is an error naming it, its line and the
// nearest known name ("did you mean listen?"): a typo must not leave a
// setting at its default (a server listening everywhere, without
// TLS). A file of a newer version than newest is refused as such, so a
// newer file's keys are not what an older daemon complains about.
func LoadTOML(path string, mustExist bool, v any, version func() int, newest int) (Meta, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) && !mustExist {
		return Meta{}, nil
	}
	if err != nil {
		return Meta{}, fmt.Errorf("config %s: %w", path, err)
	}
	md, err := toml.Decode(string(data), v)
	if err != nil {
		return Meta{}, fmt.Errorf("config %s: %w", path, err)
	}
	if n := version(); n > newest {
		return Meta{}, fmt.Errorf("config %s: version %d is newer than this daemon understands (%d)", path, n, newest)
	}
	if err := unknownKeys(path, data, md, v); err != nil {
		return Meta{}, err
	}
	return Meta{Found: true, md: md}, nil
}

// LoadConfig reads a daemon's configuration file at path over cfg (its
// defaults) as LoadTOML does; a [tls] table makes TLS required: t, cfg's
// TLS, is Configured.
func LoadConfig(path string, mustExist bool, cfg any, version func() int, newest int, t *TLS) error {
	meta, err := LoadTOML(path, mustExist, cfg, version, newest)
	t.Configured = meta.Defined("tls")
	return err
}

// Check is the rest of a daemon's `config check` once the file at path
// is loaded: the configuration valid (validate), and the TLS files it
// names (t) loaded, starting nothing.
func Check(path string, validate func() error, t TLS) error {
	if err := validate(); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	if _, err := t.Config(); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	return nil
}

// WriteFileAtomic replaces path with data so that a crash leaves either
// the old or the new content: a temporary file, synced, renamed over the
// old one, and the directory synced.
func WriteFileAtomic(path string, data []byte) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, ".state-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return err
	}
	if df, err := os.Open(dir); err == nil {
		df.Sync()
		df.Close()
	}
	return nil
}

// Versioned is a state file's content: it says its format version.
type Versioned interface{ StateVersion() int }

// LoadState reads the JSON state file at path over st and returns it. A
// missing file is no error and returns st as it was (the caller's empty
// state); a file of a newer version than newest is refused rather than
// half understood.
func LoadState[T Versioned](path string, st T, newest int) (T, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return st, nil
	}
	if err != nil {
		return st, fmt.Errorf("state file %s: %w", path, err)
	}
	if err := json.Unmarshal(b, st); err != nil {
		return st, fmt.Errorf("state file %s: %w", path, err)
	}
	if v := st.StateVersion(); v > newest {
		return st, fmt.Errorf("state file %s: version %d is newer than this daemon understands", path, v)
	}
	return st, nil
}

// SaveState writes st as indented JSON to path, atomically.
func SaveState(path string, st any) error {
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	return WriteFileAtomic(path, append(b, '\n'))
}

// ParseUserTimeout reads tcp_user_timeout: a duration of at least 100 ms,
// or "off" (returned as -1: the kernel's retransmission limits).
func ParseUserTimeout(v string) (time.Duration, error) {
	if v == "off" {
		return -1, nil
	}
	t, err := time.ParseDuration(v)
	if err != nil || t < 100*time.Millisecond || t > time.Hour {
		return 0, fmt.Errorf("tcp_user_timeout %q: want a duration from 100ms to 1h, or off", v)
	}
	return t, nil
}
