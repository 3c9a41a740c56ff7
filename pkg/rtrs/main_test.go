package rtrs

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package if any test leaves a goroutine behind: every
// session, path, connection and server must close what it started.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
