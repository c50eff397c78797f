//go:build !moexdebug

package obuf

// Debug reports whether the expensive invariant checks are compiled in (-tags moexdebug).
const Debug = false

type debugState struct{}

func (debugState) onGet(*Buf)     {}
func (debugState) onLend(*Buf)    {}
func (debugState) onReturn(*Buf)  {}
func (debugState) onRelease(*Buf) {}
