package coll

import (
	"fmt"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// envVars are the variables package coll reads.
var envVars = []transport.EnvVar{
	{Name: "MOEX_TIMEOUT", Default: bootstrap.DefaultTimeout.String(), Meaning: "no-progress deadline of every operation, a Go duration; after 30 s without progress a warning names the ranks waited for", Owner: "coll"},
	{Name: "MOEX_INIT_TIMEOUT", Default: "MOEX_TIMEOUT", Meaning: "deadline of start-up (coll.Init): every rank must have started and connected within it", Owner: "coll"},
	{Name: "MOEX_NET_GBITS", Default: fmt.Sprintf("the NIC's speed from sysfs, else %g", 8/CostNet.Beta/1e9), Meaning: "the network's speed between hosts in Gbit/s, for the cost model", Owner: "coll"},
	{Name: "MOEX_ALGO", Default: "unset (the cost model chooses)", Meaning: "algorithm overrides, op:algo[,op:algo] (for example alltoall:hier)", Owner: "coll"},
	{Name: "MOEX_WINDOWS", Default: "auto", Meaning: "auto, 1 or 0: exchanges (the MoE low-latency mode) write each block straight into the memory of same-host peers, or put it into UCX peers' registered windows where UCX's lanes do RMA (one-sided); 1: also where UCX would emulate RMA over active messages; 0: as tag messages", Owner: "coll"},
	{Name: "MOEX_DEBUG", Default: "unset (silent)", Meaning: "log level: INFO logs transports per peer and algorithms per op; DEBUG, WARN, ERROR", Owner: "coll"},
	{Name: "MOEX_PROFILE", Default: "0", Meaning: "1: time every collective's wait for the last rank apart from the operation, and name that rank (one small all-gather per op; the MoE low-latency exchanges at no extra cost)", Owner: "coll"},
	{Name: "MOEX_TRACE", Default: "unset", Meaning: "directory: at Close every rank writes a Chrome-trace JSON file of its collectives (turns MOEX_PROFILE on)", Owner: "coll"},
	{Name: "MOEX_LAUNCH_REPORT", Default: "set by moex run", Meaning: "directory where ranks say whom they blame for an abort, so that the launcher names the root cause", Owner: "coll", Internal: true},
}

// EnvVars lists every variable that coll and what it opens (the bootstrap, the poller,
// the transports) read: `moex env` prints them.
func EnvVars() []transport.EnvVar {
	return append(bootstrap.EnvVars(), envVars...)
}
