package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
)

// ErrUnauthorized is returned by Client when the server refuses the token.
var ErrUnauthorized = errors.New("admin: unauthorized (missing or wrong token)")

// Client calls the admin API. Its methods mirror etcdstore.Store and return
// the same errors (etcdstore.ErrNotFound, etcdstore.ErrConflict, and a
// *rules.FieldError for a refused rule), so callers can use either.
type Client struct {
	base  string
	token string
	hc    *http.Client
}

// NewClient returns a client for the admin API at baseURL (e.g.
// "http://127.0.0.1:8081"). token may be empty for a server without auth;
// hc nil means http.DefaultClient.
func NewClient(baseURL, token string, hc *http.Client) (*Client, error) {
	u, err := url.Parse(baseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("admin: admin URL %q must be http(s)://host[:port]", baseURL)
	}
	if hc == nil {
		hc = http.DefaultClient
	}
	return &Client{base: strings.TrimSuffix(baseURL, "/"), token: token, hc: hc}, nil
}

func (c *Client) do(ctx context.Context, method, path string, body []byte, hdr http.Header) (*http.Response, []byte, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, rd)
	if err != nil {
		return nil, nil, fmt.Errorf("admin: %w", err)
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, nil, fmt.Errorf("admin: %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, nil, fmt.Errorf("admin: %s %s: reading response: %w", method, path, err)
	}
	if resp.StatusCode >= 300 {
		return resp, b, responseError(resp, b)
	}
	return resp, b, nil
}

// remoteError is an error the admin API answered: its text is the
// server's message as it is (the server's store error already says what
// and where: wrapping it again would repeat it), and it matches the store
// errors it stands for (errors.Is, errors.As).
type remoteError struct {
	msg  string
	errs []error
}

func (e *remoteError) Error() string   { return e.msg }
func (e *remoteError) Unwrap() []error { return e.errs }

// responseError turns an error response back into the store's errors.
func responseError(resp *http.Response, body []byte) error {
	var e apiError
	if json.Unmarshal(body, &e) != nil || e.Error == "" {
		e.Error = strings.TrimSpace(string(body))
	}
	var fieldErr []error
	if e.Field != "" {
		fieldErr = []error{&rules.FieldError{Field: e.Field, Msg: e.Error}}
	}
	switch resp.StatusCode {
	case http.StatusNotFound:
		return fmt.Errorf("%w (admin API: %s)", etcdstore.ErrNotFound, e.Error)
	case http.StatusPreconditionFailed, http.StatusConflict:
		return fmt.Errorf("%w (admin API: %s)", etcdstore.ErrConflict, e.Error)
	case http.StatusUnauthorized, http.StatusForbidden:
		return ErrUnauthorized
	case http.StatusUnprocessableEntity:
		// The stored document is not a valid rule.
		return &remoteError{msg: e.Error, errs: append(fieldErr, etcdstore.ErrInvalidDocument)}
	case http.StatusBadRequest:
		if e.Field != "" {
			return &remoteError{msg: e.Error, errs: fieldErr}
		}
	}
	return fmt.Errorf("admin: %s: %s", resp.Status, e.Error)
}

func revisionOf(resp *http.Response) int64 {
	rev, err := parseETag(resp.Header.Get("ETag"))
	if err != nil {
		return 0
	}
	return rev
}

// Get returns the rule id and its mod revision.
func (c *Client) Get(ctx context.Context, id string) (rules.Rule, int64, error) {
	resp, b, err := c.do(ctx, http.MethodGet, "/rules/"+url.PathEscape(id), nil, nil)
	if err != nil {
		return rules.Rule{}, 0, err
	}
	var r rules.Rule
	if err := json.Unmarshal(b, &r); err != nil {
		return rules.Rule{}, 0, fmt.Errorf("admin: decoding rule %q: %w", id, err)
	}
	return r, revisionOf(resp), nil
}

// List returns all valid rules and the store revision.
func (c *Client) List(ctx context.Context) ([]rules.Rule, int64, error) {
	resp, b, err := c.do(ctx, http.MethodGet, "/rules", nil, nil)
	if err != nil {
		return nil, 0, err
	}
	var rs []rules.Rule
	if err := json.Unmarshal(b, &rs); err != nil {
		return nil, 0, fmt.Errorf("admin: decoding rule list: %w", err)
	}
	return rs, revisionOf(resp), nil
}

// ListAll returns all valid rules, the stored documents that are not valid
// rules, and the store revision (GET /rules?include=invalid). A server
// from before include=invalid answers the valid rules alone: then the
// invalid documents are not known (nil), as its Apportion-Invalid-Documents
// header is absent too.
func (c *Client) ListAll(ctx context.Context) ([]rules.Rule, []etcdstore.InvalidDocument, int64, error) {
	resp, b, err := c.do(ctx, http.MethodGet, "/rules?include=invalid", nil, nil)
	if err != nil {
		return nil, nil, 0, err
	}
	if t := bytes.TrimSpace(b); len(t) > 0 && t[0] == '[' {
		var rs []rules.Rule
		if err := json.Unmarshal(b, &rs); err != nil {
			return nil, nil, 0, fmt.Errorf("admin: decoding rule list: %w", err)
		}
		return rs, nil, revisionOf(resp), nil
	}
	var l listing
	if err := json.Unmarshal(b, &l); err != nil {
		return nil, nil, 0, fmt.Errorf("admin: decoding rule list: %w", err)
	}
	return l.Rules, l.Invalid, revisionOf(resp), nil
}

// Put stores r; ifMatch as in etcdstore.Store.Put. It returns the new revision.
func (c *Client) Put(ctx context.Context, r rules.Rule, ifMatch int64) (int64, error) {
	doc, err := etcdstore.Encode(r)
	if err != nil {
		return 0, err
	}
	hdr := http.Header{}
	switch {
	case ifMatch == etcdstore.MustNotExist:
		hdr.Set("If-None-Match", "*")
	case ifMatch > 0:
		hdr.Set("If-Match", etag(ifMatch))
	case ifMatch < 0:
		return 0, fmt.Errorf("admin: invalid precondition revision %d", ifMatch)
	}
	resp, _, err := c.do(ctx, http.MethodPut, "/rules/"+url.PathEscape(r.ID), doc, hdr)
	if err != nil {
		return 0, err
	}
	return revisionOf(resp), nil
}

// Delete removes the rule id; ifMatch as in etcdstore.Store.Delete.
func (c *Client) Delete(ctx context.Context, id string, ifMatch int64) error {
	hdr := http.Header{}
	if ifMatch > 0 {
		hdr.Set("If-Match", etag(ifMatch))
	} else if ifMatch < 0 {
		return fmt.Errorf("admin: invalid precondition revision %d", ifMatch)
	}
	_, _, err := c.do(ctx, http.MethodDelete, "/rules/"+url.PathEscape(id), nil, hdr)
	return err
}
