package dispatch_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Every dispatcher, communicator and non-blocking operation a test starts is gone when
// it ends.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
