package client_test

import (
	"context"
	"fmt"
	"log"
	"net"
	"time"

	"github.com/apportion/apportion/regional/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The examples ask a real enforcer at enforcerAddr (in production,
// ratelimitd's --grpc-addr, e.g. "ratelimitd.us-east.internal:8081") whose
// rules limit "POST /orders" to 3 per client and /demo.Echo/Echo to 1.

func ExampleClient_Check() {
	c, err := client.New(
		client.WithAddress(enforcerAddr),
		client.WithTimeout(time.Second),           // the default is 25ms
		client.WithFailurePolicy(client.FailOpen), // the default: allow while the enforcer is down
	)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	for range 4 {
		d, err := c.Check(context.Background(), client.Request{ClientKey: "user:42", Resource: "POST /orders"})
		if err != nil {
			log.Fatal(err) // only a bad request or the caller's context ending
		}
		if d.Allowed {
			fmt.Printf("allowed by %s, %d of %d left\n", d.RuleID, d.Remaining, d.Limit)
		} else {
			fmt.Printf("rejected by %s, retry in %v\n", d.RuleID, d.RetryAfter.Round(10*time.Second))
		}
	}
	// Output:
	// allowed by orders, 2 of 3 left
	// allowed by orders, 1 of 3 left
	// allowed by orders, 0 of 3 left
	// rejected by orders, retry in 1m40s
}

func ExampleClient_CheckBatch() {
	c, err := client.New(client.WithAddress(enforcerAddr), client.WithTimeout(time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	// One CheckLimits call for three requests (a batch of one client's
	// order lines, say), answered in order.
	ds, err := c.CheckBatch(context.Background(), []client.Request{
		{ClientKey: "user:7", Resource: "POST /orders", Cost: 2},
		{ClientKey: "user:7", Resource: "POST /orders", Cost: 2},
		{ClientKey: "user:8", Resource: "POST /orders"},
	})
	if err != nil {
		log.Fatal(err)
	}
	for _, d := range ds {
		fmt.Println(d.Allowed, d.Remaining)
	}
	// Output:
	// true 1
	// false 1
	// true 2
}

func ExampleWithBatching() {
	// Concurrent Checks leave together as one CheckLimits call when 100 are
	// waiting or 2ms after the first: fewer calls under load.
	c, err := client.New(client.WithAddress(enforcerAddr), client.WithTimeout(time.Second),
		client.WithBatching(100, 2*time.Millisecond))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	d, err := c.Check(context.Background(), client.Request{ClientKey: "user:9", Resource: "POST /orders"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(d.Allowed, d.Remaining)
	// Output: true 2
}

func ExampleClient_Check_enforcerDown() {
	// Nothing listens at this address: the failure policy answers, at the
	// latest when the deadline passes.
	c, err := client.New(client.WithAddress("127.0.0.1:1"), client.WithFailurePolicy(client.FailClosed))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	d, err := c.Check(context.Background(), client.Request{ClientKey: "user:42", Resource: "POST /login"})
	fmt.Println(d.Allowed, d.Unreachable != nil, err)
	// Output: false true <nil>
}

func ExampleDialOptions() {
	// A connection of your own to the enforcer (shared by Clients and the
	// HTTP middleware, say), remade within about a second of the enforcer
	// being back after an outage, as a Client's own is.
	conn, err := grpc.NewClient(enforcerAddr, append(client.DialOptions(),
		grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	c, err := client.New(client.WithConn(conn), client.WithTimeout(time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	d, err := c.Check(context.Background(), client.Request{ClientKey: "user:10", Resource: "POST /orders"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(d.Allowed, d.Remaining)
	// Output: true 2
}

func ExampleClient_UnaryServerInterceptor() {
	c, err := client.New(client.WithAddress(enforcerAddr), client.WithTimeout(time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	// A gRPC service whose every call is asked about first, keyed by the
	// caller's x-api-key metadata; the resource is the full method name.
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(c.UnaryServerInterceptor(client.WithKey(client.KeyFromMetadata("x-api-key")))),
		grpc.ChainStreamInterceptor(c.StreamServerInterceptor(client.WithKey(client.KeyFromMetadata("x-api-key")))),
	)
	srv.RegisterService(&echoDesc, struct{}{}) // your service's Register function
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go srv.Serve(l)
	defer srv.Stop()

	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	for range 2 {
		out := &wrapperspb.StringValue{}
		err := conn.Invoke(context.Background(), "/demo.Echo/Echo", wrapperspb.String("hi"), out)
		fmt.Println(status.Code(err))
	}
	// Output:
	// OK
	// ResourceExhausted
}
