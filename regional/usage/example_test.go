package usage_test

import (
	"fmt"

	"github.com/apportion/apportion/regional/usage"
)

func ExampleEncode() {
	rec := usage.NewRecorder(10_000)
	rec.Add("global-api", "user:42", 1, 0) // on the request path
	rec.Add("global-api", "user:42", 0, 1)
	rec.Add("global-api", "user:7", 3, 0)

	data, err := usage.Encode(usage.Batch{Region: "us-east", Enforcer: "ratelimitd-1", Seq: 1, Deltas: rec.Drain()})
	if err != nil {
		panic(err)
	}
	b, err := usage.Decode(data)
	if err != nil {
		panic(err)
	}
	fmt.Println(len(data), "bytes on", usage.Subject(b.Region))
	for _, d := range b.Deltas {
		fmt.Printf("%s %s admitted=%d rejected=%d\n", d.Rule, d.Key, d.Admitted, d.Rejected)
	}
	// Output:
	// 56 bytes on ratelimit.usage.us-east
	// global-api user:42 admitted=1 rejected=1
	// global-api user:7 admitted=3 rejected=0
}
