package core

import "testing"

// Values come back last in, first out; an empty list says so; Drain hands over the rest.
func TestFreeList(t *testing.T) {
	var l FreeList[*int]
	if _, ok := l.Get(); ok {
		t.Fatal("Get on an empty list succeeded")
	}
	a, b := new(int), new(int)
	l.Put(a)
	l.Put(b)
	if v, ok := l.Get(); !ok || v != b {
		t.Fatalf("got %p %v, want %p", v, ok, b)
	}
	var drained []*int
	l.Drain(func(v *int) { drained = append(drained, v) })
	if len(drained) != 1 || drained[0] != a {
		t.Fatalf("drained %v", drained)
	}
	if _, ok := l.Get(); ok {
		t.Fatal("Get after Drain succeeded")
	}
	allocs := testing.AllocsPerRun(100, func() {
		v, _ := l.Get()
		if v == nil {
			v = a
		}
		l.Put(v)
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per Get and Put in steady state", allocs)
	}
}
