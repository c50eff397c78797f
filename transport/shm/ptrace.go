package shm

import (
	"errors"
	"os"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Cross-memory attach (process_vm_readv) and taking a peer's descriptors (pidfd_getfd)
// need ptrace rights over the peer. Under Yama's kernel.yama.ptrace_scope=1, Ubuntu's
// default, a process has them only over its descendants: sibling ranks are refused
// unless each names who may attach to it. GrantPeers does, for every process of the
// same user (PR_SET_PTRACER_ANY), as Open MPI's CMA component does; scopes 2 and 3
// cannot be granted by a process, and where the kernel still refuses, the transport's
// probe sends large messages through the rings instead.

// PtraceGrant says what GrantPeers did.
type PtraceGrant int

const (
	// PtraceOpen: no Yama, or scope 0: the peers of the same user may attach already.
	PtraceOpen PtraceGrant = iota
	// PtraceGranted: scope 1, and this process let any process of its user attach.
	PtraceGranted
	// PtraceRefused: scope 2 or 3 (or the grant failed): the peers cannot attach.
	PtraceRefused
)

func (g PtraceGrant) String() string {
	switch g {
	case PtraceOpen:
		return "open (no Yama restriction)"
	case PtraceGranted:
		return "granted to this user's processes (PR_SET_PTRACER_ANY)"
	}
	return "refused (kernel.yama.ptrace_scope 2 or 3)"
}

var (
	grantOnce sync.Once
	granted   PtraceGrant
	grantErr  error
	// prctl and ptraceScope are the system's; tests replace them.
	prctl       = func(option int, arg2 uintptr) error { return unix.Prctl(option, arg2, 0, 0, 0) }
	ptraceScope = func() string {
		b, _ := os.ReadFile("/proc/sys/kernel/yama/ptrace_scope")
		return strings.TrimSpace(string(b))
	}
)

// GrantPeers lets the other processes of this user read this one where Yama restricts
// ptrace to descendants, once per process. Every shm transport of a process calls it
// before its segment is published, so before any peer probes it.
func GrantPeers() (PtraceGrant, error) {
	grantOnce.Do(func() { granted, grantErr = grantPeers() })
	return granted, grantErr
}

func grantPeers() (PtraceGrant, error) {
	switch ptraceScope() {
	case "", "0":
		return PtraceOpen, nil
	case "1":
		if err := prctl(unix.PR_SET_PTRACER, unix.PR_SET_PTRACER_ANY); err != nil {
			return PtraceRefused, errors.Join(errors.New("shm: prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) refused"), err)
		}
		return PtraceGranted, nil
	}
	return PtraceRefused, nil
}
