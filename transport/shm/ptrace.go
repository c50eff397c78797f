package shm

import (
	"errors"
	"fmt"
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

// ErrPtrace: the kernel refused this process a peer's memory or descriptors (EPERM from
// process_vm_readv or pidfd_getfd), where a rank needs them (PtraceError says which).
var ErrPtrace = errors.New("shm: the kernel refused access to a peer process (ptrace)")

// PtraceError says that the kernel refused rank Rank's process (PID) to this one, in Op
// (the system call), and what to change: Scope is kernel.yama.ptrace_scope as read here
// ("" without Yama). Where the refusal is on the way of an optimisation (the single copy,
// reading shared buffers in place), the transport falls back and logs it; where nothing
// can replace it (a new process taking the rank of one that died maps the live ranks'
// segments through pidfd_getfd), the operation fails with it. errors.Is matches ErrPtrace
// and the kernel's error.
type PtraceError struct {
	Rank  int
	PID   int
	Op    string // "pidfd_getfd" or "process_vm_readv"
	Scope string
	Err   error
}

func (e *PtraceError) Error() string {
	fix := "run the ranks as one user, or give them CAP_SYS_PTRACE"
	switch e.Scope {
	case "1":
		fix = "moex lets its peers attach (PR_SET_PTRACER); a process that did not (another program) must, or set kernel.yama.ptrace_scope=0"
	case "2", "3":
		fix = "set kernel.yama.ptrace_scope=1 or 0 (sysctl; 3 needs a reboot), or give the ranks CAP_SYS_PTRACE"
	}
	scope := "no Yama"
	if e.Scope != "" {
		scope = "kernel.yama.ptrace_scope=" + e.Scope
	}
	return fmt.Sprintf("shm: %s of rank %d (pid %d) refused (%s): %v; %s", e.Op, e.Rank, e.PID, scope, e.Err, fix)
}

func (e *PtraceError) Unwrap() []error { return []error{ErrPtrace, e.Err} }

// ptraceErr is err, from op on rank's process pid, as a *PtraceError where the kernel
// refused it (EPERM, EACCES), else err.
func ptraceErr(op string, rank, pid int, err error) error {
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
		return &PtraceError{Rank: rank, PID: pid, Op: op, Scope: ptraceScope(), Err: err}
	}
	return err
}

var (
	// pidfdGetfd and processVMReadv are the system's; tests replace them to refuse.
	pidfdGetfd     = unix.PidfdGetfd
	processVMReadv = unix.ProcessVMReadv
)

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
