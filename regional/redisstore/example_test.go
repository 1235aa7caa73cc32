package redisstore_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// A request matched by two rules: 10 requests per second with bursts of 20,
// and 1000 per hour. Both are checked (and consumed) in one script call.
func ExampleStore_Check() {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer client.Close()
	store, err := redisstore.New(client)
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	defer cancel()
	allowed, results, err := store.Check(ctx, 1, []redisstore.Bucket{
		{Key: redisstore.Key("user:42", "orders-free"), Algorithm: rules.TokenBucket, Capacity: 20_000, Rate: 10_000},
		{Key: redisstore.Key("user:42", "orders-hourly"), Algorithm: rules.SlidingWindow, Limit: 1000, Window: time.Hour},
	})
	if err != nil {
		log.Print("store unavailable, apply the rule's failure mode: ", err)
		return
	}
	fmt.Println(allowed, results[0].Remaining, results[1].Remaining)
}

func ExampleKey() {
	fmt.Println(redisstore.Key("user:42", "orders-free"))
	fmt.Println(redisstore.Key("{user:42}", "orders-free"))
	fmt.Println(redisstore.Key("user:42", "orders-hourly", "1h"))
	// Output:
	// rl:{user:42}:orders-free
	// rl:{%7Buser:42%7D}:orders-free
	// rl:{user:42}:orders-hourly:1h
}
