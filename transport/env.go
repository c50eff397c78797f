package transport

import (
	"fmt"
	"os"
	"strings"
)

// EnvError reports a missing or malformed variable.
type EnvError struct {
	Var    string
	Value  string
	Reason string
}

func (e *EnvError) Error() string {
	if e.Value == "" {
		return fmt.Sprintf("transport: %s: %s", e.Var, e.Reason)
	}
	return fmt.Sprintf("transport: %s=%q: %s", e.Var, e.Value, e.Reason)
}

// HostID identifies the machine: ranks with equal HostIDs share memory. MOEX_HOST_ID
// overrides it (tests use that to pretend ranks are on different hosts).
func HostID() string {
	if v := os.Getenv("MOEX_HOST_ID"); v != "" {
		return v
	}
	h, _ := os.Hostname()
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	return h + "/" + strings.TrimSpace(string(boot))
}
