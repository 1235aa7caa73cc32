// Package deploy holds the deployment files (docker-compose, Kubernetes,
// NATS, Prometheus, Grafana) and the example rules, embedded so that rlstack
// and the tests use the very files an operator deploys.
package deploy

import _ "embed"

// ExampleRules is rules.yaml: the example rule set rlstack loads.
//
//go:embed rules.yaml
var ExampleRules []byte
