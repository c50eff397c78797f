package dispatch

import (
	"reflect"
	"testing"

	"github.com/moex-ai/moex/internal/ep"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Config is the engine's configuration field for field: every field set to a value of
// its own survives the way to the engine and back, and the engine has no field that
// Config lacks (a field added there fails here until it is added here too).
func TestConfigCarriesEveryField(t *testing.T) {
	pub, eng := reflect.TypeOf(Config{}), reflect.TypeOf(ep.Config{})
	require.Equal(t, eng.NumField(), pub.NumField(), "dispatch.Config and ep.Config have as many fields")
	var cfg Config
	v := reflect.ValueOf(&cfg).Elem()
	for i := 0; i < pub.NumField(); i++ {
		f := v.Field(i)
		assert.Equal(t, pub.Field(i).Name, eng.Field(i).Name, "field %d", i)
		switch f.Kind() {
		case reflect.Int:
			f.SetInt(int64(100 + i))
		case reflect.Uint8:
			f.SetUint(uint64(i))
		case reflect.Bool:
			f.SetBool(true)
		case reflect.Pointer:
			switch f.Interface().(type) {
			case *router.Placement:
				f.Set(reflect.ValueOf(&router.Placement{Experts: 8}))
			case *obuf.Pool:
				f.Set(reflect.ValueOf(obuf.Shared))
			default:
				t.Fatalf("field %s: a pointer this test does not know", pub.Field(i).Name)
			}
		default:
			t.Fatalf("field %s of kind %v: teach this test its values", pub.Field(i).Name, f.Kind())
		}
	}
	cfg.Mode = Gathered
	assert.Equal(t, cfg, configOf(cfg.engine()))
	assert.Equal(t, ep.Gathered, cfg.engine().Mode)
	for m := Auto; m <= Gathered; m++ {
		assert.Equal(t, ep.Mode(m).String(), m.String())
		back, err := ParseMode(m.String())
		require.NoError(t, err)
		assert.Equal(t, m, back)
	}
}
