package algos

import "time"

// LinkCost is the alpha-beta(-gamma) model of one class of link.
type LinkCost struct {
	Alpha time.Duration // per message
	Beta  float64       // seconds per byte on the wire (1 / bandwidth)
	Gamma float64       // seconds per byte reduced
}

// Link classes, and their defaults, measured on the 2-core development machine with the
// transport benchmarks (inproc: 0.6us ping-pong, ~25 GB/s; tcp loopback: ~16us round
// trip, ~3-5 GB/s; reductions: ~20 GB/s f32 sums). Configure or measure for real links.
//
// Between hosts the network's speed comes from the NIC that carries the traffic (sysfs;
// transport/topo), or MOEX_NET_GBITS / Config.NetGbits. CostNVLink and CostPCIe are the
// classes of GPU memory moved between GPUs of one host (UCX's cuda_ipc over NVLink, or
// through PCIe): set them as Config.HostLink for ranks whose buffers live on GPUs.
var (
	CostInproc = LinkCost{Alpha: 1 * time.Microsecond, Beta: 1 / 20e9, Gamma: 1 / 20e9}
	CostShm    = LinkCost{Alpha: 3 * time.Microsecond, Beta: 1 / 8e9, Gamma: 1 / 20e9}
	CostNet    = LinkCost{Alpha: 15 * time.Microsecond, Beta: 1 / 3e9, Gamma: 1 / 20e9}
	CostNVLink = LinkCost{Alpha: 5 * time.Microsecond, Beta: 1 / 300e9, Gamma: 1 / 1000e9}
	CostPCIe   = LinkCost{Alpha: 8 * time.Microsecond, Beta: 1 / 25e9, Gamma: 1 / 1000e9}
)

// CrowdedAlpha multiplies the per-message latency of the default link when the ranks, all
// on one host over shared memory, outnumber its CPUs: a rank that waits for a peer gives
// up its CPU, and the peer must be switched in before the step completes, so every step
// of an algorithm costs context switches. Measured with moex bench coll over shm on 2
// CPUs (AllReduce, best of 4, alternating): 4 ranks, 64 KiB: shared (2 steps) 50us,
// rabenseifner (4) 62us; 1 MiB: 460 against 1065us; 8 ranks, 64 KiB: 117 against 264us,
// where the model at 3us a message chose the multi-step algorithms.
const CrowdedAlpha = 8
