package launch

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"
	"testing/iotest"
)

// The filter drops gossip INFOs, sets (or removes) the gateway URLs of the
// others, and passes everything else on byte for byte: other protocol
// lines, and message payloads even when they look like an INFO.
func TestGatewayFilter(t *testing.T) {
	payload := "INFO {\"gateway_cmd\":1}\r\nnot a line"
	in := `INFO {"server_id":"S","gateway":"c","gateway_url":"127.0.0.1:1","gateway_urls":["127.0.0.1:1"],"gateway_iom":true}` + "\r\n" +
		`CONNECT {"gateway":"a"}` + "\r\n" +
		`INFO {"server_id":"S","gateway":"b","gateway_urls":["127.0.0.1:5","127.0.0.1:6"],"gateway_cmd":1}` + "\r\n" +
		"RS+ $G foo\r\n" +
		`info {"gateway":"c","gateway_cmd":2,"gateway_cmd_payload":"JEc="}` + "\r\n" +
		fmt.Sprintf("RMSG $G foo %d\r\n", len(payload)) + payload + "\r\n" +
		"PING\r\n"
	for _, advertise := range []string{"127.0.0.1:9", ""} {
		// One byte at a time: lines and payloads split across reads.
		got, err := io.ReadAll(NewGatewayFilter(iotest.OneByteReader(strings.NewReader(in)), advertise))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.SplitAfter(string(got), "\r\n")
		if len(lines) != 9 || lines[8] != "" { // 7 lines, the payload holds a CRLF
			t.Fatalf("advertise %q: got %q", advertise, got)
		}
		var info map[string]any
		if err := json.Unmarshal([]byte(strings.TrimSuffix(strings.TrimPrefix(lines[0], "INFO "), "\r\n")), &info); err != nil {
			t.Fatalf("first INFO %q: %v", lines[0], err)
		}
		want := map[string]any{"server_id": "S", "gateway": "c", "gateway_iom": true}
		if advertise != "" {
			want["gateway_url"], want["gateway_urls"] = advertise, []any{advertise}
		}
		if !equalJSON(info, want) {
			t.Errorf("advertise %q: first INFO %v, want %v", advertise, info, want)
		}
		wantRest := "CONNECT {\"gateway\":\"a\"}\r\n" + // the gossip INFO is gone
			"RS+ $G foo\r\n" +
			"info {\"gateway\":\"c\",\"gateway_cmd\":2,\"gateway_cmd_payload\":\"JEc=\"}\r\n" +
			fmt.Sprintf("RMSG $G foo %d\r\n", len(payload)) + payload + "\r\n" +
			"PING\r\n"
		if rest := strings.Join(lines[1:], ""); rest != wantRest {
			t.Errorf("advertise %q: after the first INFO\n got %q\nwant %q", advertise, rest, wantRest)
		}
	}
}

func equalJSON(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y)
}

// A line longer than the filter's buffer, and a last line with no end,
// pass on as they are.
func TestGatewayFilterLongAndPartialLines(t *testing.T) {
	long := "-ERR '" + strings.Repeat("x", 200<<10) + "'\r\n"
	in := long + "PING\r\nINFO {\"gateway_urls\":[\"x\"]"
	got, err := io.ReadAll(NewGatewayFilter(strings.NewReader(in), "y"))
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != in {
		t.Fatalf("got %d bytes, want the %d bytes as they were", len(got), len(in))
	}
}
