//go:build ucx

package coll

import (
	"context"
	"fmt"
	"testing"
)

// BenchmarkExchangeUCX: one exchange of 900 KiB blocks (and a 1 KiB field) between UCX
// ranks of this process, through one-sided windows and as tag messages.
func BenchmarkExchangeUCX(b *testing.B) {
	const small, big = 1 << 10, 900 << 10
	for _, p := range []int{2, 4} {
		for _, windows := range []bool{true, false} {
			b.Run(fmt.Sprintf("P=%d/windows=%v", p, windows), func(b *testing.B) {
				cs, _ := ucxCommsB(b, p, Config{NoWindows: !windows})
				xs := make([]*Exchange, p)
				noErr(b, runOn(cs, func(c *Comm) error {
					x, err := c.NewExchange(context.Background(), ExchangeConfig{Fields: []int{small, big}, Slots: 2})
					xs[c.Rank()] = x
					return err
				}))
				defer func() {
					for _, x := range xs {
						x.Close()
					}
				}()
				b.SetBytes(int64((p - 1) * (small + big)))
				b.ResetTimer()
				noErr(b, runOn(cs, func(c *Comm) error {
					ctx := context.Background()
					x := xs[c.Rank()]
					for i := 0; i < b.N; i++ {
						o, err := x.Begin(ctx)
						if err != nil {
							return err
						}
						for {
							q, _, err := o.NextDest(ctx)
							if err != nil || q < 0 {
								if err != nil {
									return err
								}
								break
							}
							if err := o.Send(q, small, big); err != nil {
								return err
							}
						}
						if err := o.Wait(ctx); err != nil {
							return err
						}
					}
					return nil
				}))
			})
		}
	}
}
