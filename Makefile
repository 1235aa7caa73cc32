GO ?= go
PROTOC ?= protoc
BIN := bin

.PHONY: all build test test-short race proto bench run vet fmt

all: build

# VERSION, when set, is what every binary's --version reports
# (make build VERSION=v1.2.3); else the build information decides.
VERSION ?=
build:
	$(GO) build $(if $(VERSION),-ldflags "-X github.com/apportion/apportion/internal/version.Version=$(VERSION)") -o $(BIN)/ ./cmd/...

test:
	bash .ci/test

test-short:
	FUZZ=0 bash .ci/test -short

race:
	$(GO) test -race ./...

vet:
	$(GO) vet ./...

fmt:
	gofmt -l -w .

# proto regenerates the committed Go code. Needs protoc, protoc-gen-go and
# protoc-gen-go-grpc on PATH:
#   apt-get install protobuf-compiler
#   go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
#   go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
proto:
	$(PROTOC) -I proto --go_out=proto --go_opt=paths=source_relative \
		--go-grpc_out=proto --go-grpc_opt=paths=source_relative \
		proto/ratelimit/v1/ratelimit.proto

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./regional/...

run:
	$(GO) run ./cmd/rlstack $(ARGS)
