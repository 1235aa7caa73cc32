package regional

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// InvalidCounter is implemented by a service that counts the calls it
// refuses (apportion_requests_total{result="invalid"} under its protocol):
// RegisterService calls CountInvalid for a request refused before the
// service sees it, one that does not decode or is over the server's
// message size limit.
type InvalidCounter interface {
	CountInvalid()
}

// RegisterService registers impl for desc on s, a server from
// NewGRPCServer, as the generated Register functions do, except that a
// request that does not decode answers InvalidArgument naming the method
// (gRPC itself answers Internal: it cannot tell a client's bad bytes from a
// server fault), and that when impl is an InvalidCounter such a request,
// and one over the server's message size limit (ResourceExhausted), is
// counted with it. Streaming methods are registered as they are.
func RegisterService(s *grpc.Server, desc *grpc.ServiceDesc, impl any) {
	RegisterServiceLenient(s, desc, impl, nil)
}

// RegisterServiceLenient is RegisterService for a service whose requests
// may hold strings that are not valid UTF-8 (proto3 refuses them; a
// gateway forwards such header bytes as they came): when the proto codec
// refuses a request, lenient decodes it instead, leaving the strings as
// sent for the service to deal with. lenient returns an error for a message
// it does not decode too; nil lenient is RegisterService.
func RegisterServiceLenient(s *grpc.Server, desc *grpc.ServiceDesc, impl any, lenient func(data []byte, msg any) error) {
	d := *desc
	refused := func() {}
	if c, ok := impl.(InvalidCounter); ok {
		refused = c.CountInvalid
	}
	d.Methods = make([]grpc.MethodDesc, len(desc.Methods))
	for i, m := range desc.Methods {
		name, handler := desc.ServiceName+"/"+m.MethodName, m.Handler
		d.Methods[i] = grpc.MethodDesc{MethodName: m.MethodName,
			Handler: func(srv any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
				return handler(srv, ctx, func(v any) error {
					t := &decodeTarget{msg: v, lenient: lenient}
					if err := dec(t); err != nil {
						if status.Code(err) == codes.ResourceExhausted {
							refused() // over the message size limit
						}
						return err // not a decoding error: a read or size limit
					}
					if t.err != nil {
						refused()
						return status.Errorf(codes.InvalidArgument, "malformed %s request: %v", name, t.err)
					}
					return nil
				}, ic)
			}}
	}
	s.RegisterService(&d, impl)
}

// decodeTarget is what a RegisterService handler asks the codec to decode
// into: the codec decodes into msg and records a failure in err instead of
// failing the read.
type decodeTarget struct {
	msg     any
	err     error
	lenient func(data []byte, msg any) error // the service's own decoder, tried when the codec refuses
}
