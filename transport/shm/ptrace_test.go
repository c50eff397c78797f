package shm

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Under each of Yama's scopes the grant does what lets sibling ranks read one another:
// nothing without Yama or at 0, PR_SET_PTRACER_ANY at 1 (Ubuntu's default), and at 2 or
// 3, which no process can lift, it says refused (the CMA probe then picks the rings). A
// prctl that fails is a refusal with the kernel's error.
func TestGrantPeersUnderYama(t *testing.T) {
	defer func(p func(int, uintptr) error, s func() string) { prctl, ptraceScope = p, s }(prctl, ptraceScope)
	for _, tc := range []struct {
		scope    string
		prctlErr error
		want     PtraceGrant
		called   bool
	}{
		{"", nil, PtraceOpen, false},
		{"0", nil, PtraceOpen, false},
		{"1", nil, PtraceGranted, true},
		{"1", unix.EPERM, PtraceRefused, true},
		{"2", nil, PtraceRefused, false},
		{"3", nil, PtraceRefused, false},
	} {
		var option int
		var arg uintptr
		called := false
		prctl = func(o int, a uintptr) error { option, arg, called = o, a, true; return tc.prctlErr }
		ptraceScope = func() string { return tc.scope }
		got, err := grantPeers()
		assert.Equal(t, tc.want, got, "scope %q", tc.scope)
		assert.Equal(t, tc.called, called, "scope %q: prctl called", tc.scope)
		if tc.called {
			assert.Equal(t, unix.PR_SET_PTRACER, option)
			assert.Equal(t, uintptr(unix.PR_SET_PTRACER_ANY), arg)
		}
		if tc.prctlErr != nil {
			require.ErrorIs(t, err, tc.prctlErr)
		} else {
			require.NoError(t, err)
		}
	}
}

// On this host the grant works (or has nothing to do), and every transport asks once.
func TestGrantPeersHere(t *testing.T) {
	g, err := GrantPeers()
	require.NoError(t, err)
	assert.NotEqual(t, PtraceRefused, g, "ptrace_scope here: %q", ptraceScope())
}
