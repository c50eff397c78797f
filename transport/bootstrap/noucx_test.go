//go:build !ucx

package bootstrap

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/moex-ai/moex/busypoll"
)

// Without -tags ucx, MOEX_TRANSPORT=ucx is an ArgError that says how to get UCX, and the
// automatic choice says why tcp carries traffic between hosts.
func TestUCXNotBuilt(t *testing.T) {
	env := Env{Rank: 0, Size: 2, Transport: "ucx"}
	_, _, err := openOptional(context.Background(), env, nil, nil, true, busypoll.Config{}, nil)
	var ae *ArgError
	if !errors.As(err, &ae) || ae.Arg != "MOEX_TRANSPORT" || !strings.Contains(err.Error(), "-tags ucx") {
		t.Fatalf("got %v, want an ArgError on MOEX_TRANSPORT naming -tags ucx", err)
	}
	tr, why, err := openOptional(context.Background(), env, nil, nil, false, busypoll.Config{}, nil)
	if tr != nil || err != nil || !strings.Contains(why, "UCX not built") {
		t.Fatalf("auto: %v %q %v", tr, why, err)
	}
}
