// Package long holds the -long test flag. The tests of the packages that import it run
// their quick cut by default, as `go test -race ./...` does; with -long they also run the
// slow scenarios: the full collective matrices (every element type and rank count, 1 MiB
// sizes), the largest messages of the transport conformance suite, and every variant of
// the multi-process scenarios. scripts/test-long.sh runs those packages with -long.
package long

import "flag"

var enabled = flag.Bool("long", false, "also run the slow scenarios (full matrices, largest sizes; see scripts/test-long.sh)")

// Enabled reports whether -long was given.
func Enabled() bool { return *enabled }
