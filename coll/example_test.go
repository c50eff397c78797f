package coll_test

import (
	"context"
	"fmt"
	"sync"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
)

// onEvery runs f on every rank of cs at once, as one process per rank would.
func onEvery(cs []*coll.Comm, f func(c *coll.Comm) error) error {
	errs := make([]error, len(cs))
	var wg sync.WaitGroup
	for i, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(c)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// Four ranks, goroutines of this process, sum a vector in place.
func ExampleAllReduce() {
	ctx := context.Background()
	cs, err := coll.Local(4, coll.Config{})
	if err != nil {
		panic(err)
	}
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	out := make([][]float32, len(cs))
	err = onEvery(cs, func(c *coll.Comm) error {
		x := []float32{float32(c.Rank()), 1}
		out[c.Rank()] = x
		return coll.AllReduce(ctx, c, nil, x, dtype.Sum) // nil send: in place on x
	})
	fmt.Println(out[0], out[3], err)
	// Output: [6 4] [6 4] <nil>
}

// Rank r sends block j of its buffer to rank j.
func ExampleAlltoAll() {
	ctx := context.Background()
	cs, err := coll.Local(3, coll.Config{})
	if err != nil {
		panic(err)
	}
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	recv := make([][]int32, len(cs))
	err = onEvery(cs, func(c *coll.Comm) error {
		send := make([]int32, 3)
		for j := range send {
			send[j] = int32(10*c.Rank() + j) // 10*from + to
		}
		recv[c.Rank()] = make([]int32, 3)
		return coll.AlltoAll(ctx, c, send, recv[c.Rank()])
	})
	fmt.Println(recv[1], err)
	// Output: [1 11 21] <nil>
}

// A Group waits for several non-blocking collectives submitted together.
func ExampleGroup() {
	ctx := context.Background()
	cs, err := coll.Local(2, coll.Config{})
	if err != nil {
		panic(err)
	}
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	sums := make([][]float64, len(cs))
	gathered := make([][]int64, len(cs))
	err = onEvery(cs, func(c *coll.Comm) error {
		a := []float64{1.5, float64(c.Rank())}
		all := make([]int64, c.Size())
		var g coll.Group
		g.Add(coll.IAllReduce(ctx, c, nil, a, dtype.Sum)) // nil send: in place on a
		g.Add(coll.IAllGather(ctx, c, []int64{int64(100 + c.Rank())}, all))
		err := g.Wait(ctx)
		sums[c.Rank()], gathered[c.Rank()] = a, all
		return err
	})
	fmt.Println(sums[1], gathered[0], err)
	// Output: [3 1] [100 101] <nil>
}
