package envoy

import (
	"fmt"

	"github.com/apportion/apportion/regional"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// decodeLenient decodes a RateLimitRequest that proto3 refused because a
// string (the domain, an entry's key or value) is not valid UTF-8. Envoy
// forwards header bytes as they came (HTTP allows bytes 0x80-0xFF in a
// header value), and a call refused for them would be answered by Envoy's
// failure_mode_deny (default: allow): a client could skip every limit keyed
// on a header by adding one such byte. Decoded here with the strings as
// sent, such a descriptor is limited like any other: the mapping turns a
// part that is not valid UTF-8 into its sha256: form (mapped). Fields it
// does not know, or of another wire type than theirs, are skipped, as proto
// keeps them as unknown fields; a message field given twice is merged and a
// scalar's last value wins, as in proto.
func decodeLenient(data []byte, msg any) error {
	req, ok := msg.(*rlsv3.RateLimitRequest)
	if !ok {
		return fmt.Errorf("envoy: no lenient decoding for %T", msg)
	}
	req.Reset()
	return regional.WalkFields(data, func(num protowire.Number, typ protowire.Type, raw []byte, v uint64) error {
		switch {
		case num == 1 && typ == protowire.BytesType:
			req.Domain = string(raw)
		case num == 2 && typ == protowire.BytesType:
			d := &ratelimitv3.RateLimitDescriptor{}
			if err := decodeDescriptor(raw, d); err != nil {
				return err
			}
			req.Descriptors = append(req.Descriptors, d)
		case num == 3 && typ == protowire.VarintType:
			req.HitsAddend = uint32(v)
		}
		return nil
	})
}

func decodeDescriptor(data []byte, d *ratelimitv3.RateLimitDescriptor) error {
	merge := proto.UnmarshalOptions{Merge: true, DiscardUnknown: true}
	return regional.WalkFields(data, func(num protowire.Number, typ protowire.Type, raw []byte, v uint64) error {
		switch {
		case num == 1 && typ == protowire.BytesType:
			e := &ratelimitv3.RateLimitDescriptor_Entry{}
			err := regional.WalkFields(raw, func(num protowire.Number, typ protowire.Type, raw []byte, _ uint64) error {
				switch {
				case num == 1 && typ == protowire.BytesType:
					e.Key = string(raw)
				case num == 2 && typ == protowire.BytesType:
					e.Value = string(raw)
				}
				return nil
			})
			if err != nil {
				return err
			}
			d.Entries = append(d.Entries, e)
		case num == 2 && typ == protowire.BytesType: // no strings inside
			if d.Limit == nil {
				d.Limit = &ratelimitv3.RateLimitDescriptor_RateLimitOverride{}
			}
			return merge.Unmarshal(raw, d.Limit)
		case num == 3 && typ == protowire.BytesType:
			if d.HitsAddend == nil {
				d.HitsAddend = &wrapperspb.UInt64Value{}
			}
			return merge.Unmarshal(raw, d.HitsAddend)
		case num == 4 && typ == protowire.VarintType:
			d.IsNegativeHits = v != 0
		}
		return nil
	})
}
