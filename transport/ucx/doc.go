// Package ucx is moex's transport over UCX (libucp), the communication library Open MPI and
// many NCCL deployments use: it drives InfiniBand/RoCE verbs, shared memory and TCP, and,
// when UCX is built with CUDA, GPU memory (GPUDirect RDMA).
//
// It is the only package with cgo, and only in builds with -tags ucx (Debian: libucx-dev;
// UCX 1.13 here); without the tag it compiles to a stub whose New reports that moex was
// not built with UCX, so the module builds and tests with cgo off.
//
// The binding is small and written for moex (the upstream Go bindings need UCX 1.14):
// one context and one worker per rank, endpoints from worker addresses exchanged at the
// rendezvous, tag send/receive. UCX tags are 64 bits: moex puts a hash of (source,
// communicator, sequence, tag) there and sends a 24-byte header with the full tag and
// the operation signature, which the receiver checks (a mismatch is ErrMismatch, not a
// silent cross-match). Small messages travel as one UCX message [header|payload]; large
// ones as the header followed by the payload on a tag of its own, received contiguously
// into the posted buffer (so UCX's zero-copy rendezvous applies), with the memory handle
// from the registration cache when the buffer was registered (Register): memory is
// registered once per buffer, never per message. Progress (ucp_worker_progress) is
// driven by waiting goroutines under the busypoll policy, and by a progress goroutine
// that sleeps on the worker's event descriptor otherwise.
//
// Which UCX transports carry each peer's traffic is read back from UCX (ucp_ep_print_info)
// and reported by Path, the INFO log and `moex doctor`; a UCX that fell back to TCP is
// called out as such.
package ucx
