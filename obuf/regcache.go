package obuf

import (
	"sort"
	"sync"
	"unsafe"
)

// RegCache remembers, per buffer, the registration a transport made of it (a UCX memory
// handle, an RDMA memory region), so that memory is registered once per buffer and never
// per message. Registrations are looked up by address: a send from any part of a
// registered buffer finds its handle. The cache is the transport's; obuf owns the rule
// that a pooled buffer never moves or shrinks, which is what makes caching safe.
type RegCache struct {
	register   func(b []byte) (any, error)
	deregister func(h any)

	mu      sync.RWMutex
	entries []regEntry // sorted by start
}

type regEntry struct {
	start, end uintptr
	h          any
	buf        *Buf
}

// NewRegCache returns a cache that registers with register and releases with deregister.
func NewRegCache(register func(b []byte) (any, error), deregister func(h any)) *RegCache {
	return &RegCache{register: register, deregister: deregister}
}

func span(b []byte) (uintptr, uintptr) {
	s := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return s, s + uintptr(cap(b))
}

// Register registers b's whole storage once; later calls return the same handle.
func (c *RegCache) Register(b *Buf) (any, error) {
	s, e := span(b.b)
	c.mu.RLock()
	for _, x := range c.entries {
		if x.start == s && x.end == e {
			c.mu.RUnlock()
			return x.h, nil
		}
	}
	c.mu.RUnlock()
	h, err := c.register(b.b[:cap(b.b)])
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, x := range c.entries { // registered meanwhile by another goroutine
		if x.start == s && x.end == e {
			c.deregister(h)
			return x.h, nil
		}
	}
	c.entries = append(c.entries, regEntry{s, e, h, b})
	sort.Slice(c.entries, func(i, j int) bool { return c.entries[i].start < c.entries[j].start })
	return h, nil
}

// Lookup returns the handle of the registered buffer that contains p, or nil.
func (c *RegCache) Lookup(p []byte) any {
	if len(p) == 0 {
		return nil
	}
	s, _ := span(p)
	e := s + uintptr(len(p))
	c.mu.RLock()
	defer c.mu.RUnlock()
	i := sort.Search(len(c.entries), func(i int) bool { return c.entries[i].start > s })
	if i == 0 {
		return nil
	}
	x := c.entries[i-1]
	if s >= x.start && e <= x.end {
		return x.h
	}
	return nil
}

// Len returns the number of registrations.
func (c *RegCache) Len() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.entries)
}

// Close releases every registration.
func (c *RegCache) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, x := range c.entries {
		c.deregister(x.h)
	}
	c.entries = nil
}
