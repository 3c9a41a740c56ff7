// Package logtail is what the benchmark tools say of a daemon that
// failed: the end of its log.
package logtail

import (
	"io"
	"os"
	"strings"
)

// Tail is the last 500 bytes of the file at path (of its first MiB), or
// why it could not be read.
func Tail(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	b, _ := io.ReadAll(io.LimitReader(f, 1<<20))
	s := strings.TrimSpace(string(b))
	if len(s) > 500 {
		s = "…" + s[len(s)-500:]
	}
	return s
}
