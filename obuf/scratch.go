package obuf

// Scratch is a growable buffer taken from a pool, for callers that reuse one buffer
// across calls (the MoE dispatch and combine wire buffers, expert inputs): Bytes(n)
// returns n bytes of it, trading it for a bigger one from the pool when it is too small.
// Its storage is a pooled Buf, so it has the pool's properties (page aligned, huge pages
// from SlabMin on: cross-memory attach and RDMA registration at full speed), and
// steady-state use allocates nothing. The zero value uses Default.
type Scratch struct {
	Pool *Pool // where the buffer comes from (nil: Default)
	b    *Buf
}

// Bytes returns n bytes of storage. Their contents are unspecified when the buffer had
// to grow; otherwise they are what was last written. Slices returned earlier are invalid
// once a call grows the buffer (the old storage goes back to the pool).
func (s *Scratch) Bytes(n int) []byte {
	if s.b == nil || s.b.Cap() < n {
		p := s.Pool
		if p == nil {
			p = Default
		}
		if s.b != nil {
			s.b.Release()
		}
		s.b = p.Get(n)
	}
	s.b.Resize(n)
	return s.b.Bytes()
}

// Cap is the capacity of the storage held: the largest n that Bytes returns without
// growing; 0 when it holds none.
func (s *Scratch) Cap() int {
	if s.b == nil {
		return 0
	}
	return s.b.Cap()
}

// Release returns the storage to its pool; a later Bytes takes new storage.
func (s *Scratch) Release() {
	if s.b != nil {
		s.b.Release()
		s.b = nil
	}
}
