package obuf_test

import (
	"fmt"

	"github.com/moex-ai/moex/obuf"
)

// Take a buffer for a collective's data from the default pool, hold the *Buf while its
// bytes are in use, and give it back.
func ExamplePool_Get() {
	b := obuf.Default.Get(3 << 20) // 3 MiB: huge pages where the host has them
	defer b.Release()
	data := b.Bytes()
	data[0], data[len(data)-1] = 1, 2
	fmt.Println(b.Len(), data[0]+data[len(data)-1])
	// Output: 3145728 3
}
