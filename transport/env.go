package transport

import (
	"fmt"
	"os"
	"strings"
)

// EnvError reports a missing or malformed variable.
type EnvError struct {
	Var    string // the variable
	Value  string // its value
	Reason string // what is wrong with it
}

func (e *EnvError) Error() string {
	if e.Value == "" {
		return fmt.Sprintf("transport: %s: %s", e.Var, e.Reason)
	}
	return fmt.Sprintf("transport: %s=%q: %s", e.Var, e.Value, e.Reason)
}

// EnvVar describes one environment variable that moex reads: the package that reads it
// lists it, and `moex env` prints them all (coll.EnvVars gathers them).
type EnvVar struct {
	Name     string // the variable
	Default  string // what applies when it is unset, from the code's constant where there is one
	Meaning  string // what it does
	Owner    string // the package that reads it
	Internal bool   // set by moex for its own processes, or for developers: users leave it alone
}

// EnvVars are the variables package transport reads.
var EnvVars = []EnvVar{
	{Name: "MOEX_HOST_ID", Default: "hostname and boot id", Meaning: "the host identity that decides which ranks share memory", Owner: "transport"},
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
