//go:build !linux

// Command twocopy measures the floor of a two-copy shared-memory AlltoAll; it needs Linux
// (memfd, sched_yield).
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "twocopy: Linux only")
	os.Exit(2)
}
