package main

// The registry of the environment variables moex reads: name, default, meaning and the
// package that reads it, each listed by the package that reads it. `moex env` prints it,
// docs/ENVIRONMENT.md's table is generated from it (moex env --markdown), and a test fails when
// the code reads a MOEX_ variable that is not registered, or registers one that nothing
// reads.

import (
	"cmp"
	"slices"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/transport"
)

// envVars lists every variable, user ones first, in the order a reader meets them: those
// of the packages that read them (coll.EnvVars: coll, the bootstrap, the poller, the
// transports), and the command's own.
var envVars = func() []transport.EnvVar {
	vs := append(coll.EnvVars(),
		transport.EnvVar{Name: "MOEX_BENCH_WORKER", Default: "set by moex bench", Meaning: "1 in the rank processes a benchmark launches", Owner: "cmd/moex", Internal: true},
		transport.EnvVar{Name: "MOEX_CHAOS_DIR", Default: "set by moex bench moe --chaos", Meaning: "where the ranks of a chaos run write their pids", Owner: "cmd/moex", Internal: true},
		transport.EnvVar{Name: "MOEX_CHAOS_UNTIL", Default: "set by moex bench moe --chaos", Meaning: "when a chaos run ends (Unix ns), the same for every process", Owner: "cmd/moex", Internal: true},
		transport.EnvVar{Name: "MOEX_CHAOS_EVERY", Default: "5s-15s", Meaning: "MIN-MAX: how often moex bench moe --chaos strikes (tests)", Owner: "cmd/moex", Internal: true},
		transport.EnvVar{Name: "MOEX_CHAOS_STOPS", Default: "1", Meaning: "0: moex bench moe --chaos only kills, never SIGSTOPs (tests)", Owner: "cmd/moex", Internal: true},
		transport.EnvVar{Name: "MOEX_CPUPROFILE", Default: "unset", Meaning: "directory: every moex process writes a CPU profile there", Owner: "cmd/moex", Internal: true},
	)
	slices.SortStableFunc(vs, func(a, b transport.EnvVar) int {
		return cmp.Compare(b2i(a.Internal), b2i(b.Internal))
	})
	return vs
}()

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// lookupVar returns the registered variable name.
func lookupVar(name string) (transport.EnvVar, bool) {
	for _, v := range envVars {
		if v.Name == name {
			return v, true
		}
	}
	return transport.EnvVar{}, false
}
