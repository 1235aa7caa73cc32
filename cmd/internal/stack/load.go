package stack

import (
	"context"
	"time"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// The demo traffic of --load: one client key on the global rule, its demand
// moving from region to region.
const (
	GlobalRule   = "user-global"
	DemoKey      = "user:demo"
	DemoResource = "GET /feed"
	// DemoRate is the total demand, requests per second (the rule allows 100/s).
	DemoRate = 150
	// DemoPhase is how long the demand stays in one region.
	DemoPhase = 20 * time.Second
)

// Load sends demo traffic until ctx is done: DemoRate requests per second
// for DemoKey, 80% of it in one region and the rest spread over the others;
// the busy region changes every DemoPhase.
func (s *Stack) Load(ctx context.Context) error {
	clients := make([]ratelimitv1.RateLimiterClient, len(s.Regions))
	for i, r := range s.Regions {
		cc, err := grpc.NewClient(r.GRPCAddr, append(client.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...) // back within a second of a restarted enforcer
		if err != nil {
			return err
		}
		defer cc.Close()
		clients[i] = ratelimitv1.NewRateLimiterClient(cc)
	}
	start := time.Now()
	tick := time.NewTicker(time.Second / DemoRate)
	defer tick.Stop()
	req := &ratelimitv1.CheckLimitRequest{ClientKey: DemoKey, Resource: DemoResource}
	for n := 0; ; n++ {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		busy := int(time.Since(start)/DemoPhase) % len(clients)
		target := busy
		if len(clients) > 1 && n%10 >= 8 { // 20% elsewhere
			target = (busy + 1 + n%(len(clients)-1)) % len(clients)
		}
		go func(c ratelimitv1.RateLimiterClient) {
			cctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			c.CheckLimit(cctx, req)
		}(clients[target])
	}
}
