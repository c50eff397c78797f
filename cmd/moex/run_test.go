package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// moex run's node flags refuse what cannot run, as usage errors (exit 2): several nodes
// without a rendezvous, a node rank out of range, a rendezvous that is not etcd's, and a
// rendezvous without the job secret exported for every agent.
func TestRunNodeFlagsRefused(t *testing.T) {
	t.Setenv("MOEX_JOB_TOKEN", "")
	for _, args := range [][]string{
		{"-n", "2", "--nnodes", "2", "true"},
		{"-n", "2", "--nnodes", "2", "--node-rank", "2", "--rdzv", "etcd://127.0.0.1:2379/j", "true"},
		{"-n", "2", "--node-rank", "-1", "true"},
		{"-n", "2", "--nnodes", "0", "true"},
		{"-n", "2", "--nnodes", "2", "--rdzv", "127.0.0.1:2379", "true"},
		{"-n", "2", "--nnodes", "2", "--rdzv", "etcd://127.0.0.1:2379", "true"},
		{"-n", "2", "--nnodes", "2", "--rdzv", "etcd://127.0.0.1:2379/j", "true"},
	} {
		err := cmdRun(context.Background(), args)
		var ue *usageError
		require.ErrorAs(t, err, &ue, "%v", args)
		require.Equal(t, 2, exitCode(err), "%v", args)
	}
}
