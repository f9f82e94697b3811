// Command gateway is a test gateway for the InferencePool e2e test: an HTTP server that asks an endpoint
// picker for every request over ext_proc (as Envoy does: request headers, then the whole body), forwards
// the request to the pod the picker chose (the x-gateway-destination-endpoint header it sets), and streams
// the response back to the client while passing its headers and body chunks to the picker, which counts
// the tokens from the usage it reads there. It says which pod served in the x-test-picked-endpoint header.
//
//	gateway -listen 127.0.0.1:8080 -picker 10.0.0.5:9002 [-proxy socks5://user:secret@127.0.0.1:1080]
//
// With -proxy it reaches the picker and the pods through that SOCKS5 proxy (the test cluster's relay into
// its network namespace); it listens on this machine's loopback.
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"golang.org/x/net/proxy"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

const (
	destinationHeader = "x-gateway-destination-endpoint"
	pickedHeader      = "x-test-picked-endpoint"
	maxBody           = 4 << 20
)

type gateway struct {
	picker   extproc.ExternalProcessorClient
	upstream *http.Client
}

func main() {
	listen := flag.String("listen", "127.0.0.1:8080", "address to serve HTTP on")
	picker := flag.String("picker", "", "the endpoint picker's ext_proc address (host:port)")
	via := flag.String("proxy", "", "a SOCKS5 proxy URL to reach the picker and the pods through")
	flag.Parse()
	if *picker == "" {
		log.Fatal("-picker is required")
	}
	dial := (&net.Dialer{Timeout: 10 * time.Second}).DialContext
	if *via != "" {
		u, err := url.Parse(*via)
		if err != nil {
			log.Fatal(err)
		}
		d, err := proxy.FromURL(u, proxy.Direct)
		if err != nil {
			log.Fatal(err)
		}
		dial = d.(proxy.ContextDialer).DialContext
	}
	// The picker serves TLS with a self-signed certificate by default (--secure-serving)
	creds := credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec // a test's picker
	conn, err := grpc.NewClient("passthrough:///"+*picker, grpc.WithTransportCredentials(creds),
		grpc.WithContextDialer(func(ctx context.Context, address string) (net.Conn, error) {
			return dial(ctx, "tcp", address)
		}))
	if err != nil {
		log.Fatal(err)
	}
	g := &gateway{picker: extproc.NewExternalProcessorClient(conn),
		upstream: &http.Client{Timeout: 10 * time.Minute,
			Transport: &http.Transport{DisableCompression: true, DialContext: dial}}}
	log.Printf("gateway on %s, picker %s", *listen, *picker)
	log.Fatal(http.ListenAndServe(*listen, g))
}

func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil || len(body) > maxBody {
		http.Error(w, "body unreadable or too large", http.StatusRequestEntityTooLarge)
		return
	}
	// The exchange with the picker outlives the client's connection (a client that has its whole answer
	// hangs up at once, and the picker must still read the last part); the request to the pod does not
	exchange, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 15*time.Minute)
	defer cancel()
	ctx := r.Context()
	stream, err := g.picker.Process(exchange)
	if err != nil {
		http.Error(w, "picker: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer stream.CloseSend() //nolint:errcheck // the stream ends with the request either way
	headers := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(r.Method)}, {Key: ":path", RawValue: []byte(r.URL.RequestURI())},
		{Key: ":authority", RawValue: []byte(r.Host)}, {Key: ":scheme", RawValue: []byte("http")},
	}
	for name, values := range r.Header {
		for _, value := range values {
			headers = append(headers, &corev3.HeaderValue{Key: strings.ToLower(name), RawValue: []byte(value)})
		}
	}
	send := func(req *extproc.ProcessingRequest) error {
		err := stream.Send(req)
		if err != nil {
			log.Printf("sending to the picker: %v", err)
		}
		return err
	}
	if err := send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extproc.HttpHeaders{Headers: &corev3.HeaderMap{Headers: headers}}}}); err != nil {
		http.Error(w, "picker: "+err.Error(), http.StatusBadGateway)
		return
	}
	if err := send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
		RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
		http.Error(w, "picker: "+err.Error(), http.StatusBadGateway)
		return
	}
	destination, set, newBody, err := pick(stream, w)
	if err != nil || destination == "" {
		if err != nil && !errors.Is(err, errAnswered) {
			http.Error(w, "picker: "+err.Error(), http.StatusBadGateway)
		} else if destination == "" && err == nil {
			http.Error(w, "picker chose no endpoint", http.StatusBadGateway)
		}
		return
	}
	if newBody != nil {
		body = newBody
	}
	upstream, err := http.NewRequestWithContext(ctx, r.Method, "http://"+destination+r.URL.RequestURI(),
		bytes.NewReader(body))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	upstream.Header = r.Header.Clone()
	for key, value := range set {
		if !strings.HasPrefix(key, ":") && key != "content-length" {
			upstream.Header.Set(key, value)
		}
	}
	upstream.ContentLength = int64(len(body))
	response, err := g.upstream.Do(upstream)
	if err != nil {
		http.Error(w, "upstream: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer response.Body.Close()
	// The picker's answers to the response's parts are not needed, only read; the exchange ends when the
	// picker has read the last part (it counts a whole body's usage then), not when the client is answered
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		for {
			if _, err := stream.Recv(); err != nil {
				if !errors.Is(err, io.EOF) {
					log.Printf("picker stream for %s ended: %v", r.URL.Path, err)
				}
				return
			}
		}
	}()
	defer func() {
		_ = stream.CloseSend()
		select {
		case <-drained:
		case <-time.After(10 * time.Second):
		}
	}()
	responseHeaders := []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(response.StatusCode))},
		{Key: "status", RawValue: []byte(strconv.Itoa(response.StatusCode))}}
	for name, values := range response.Header {
		for _, value := range values {
			responseHeaders = append(responseHeaders, &corev3.HeaderValue{Key: strings.ToLower(name), RawValue: []byte(value)})
		}
		w.Header()[name] = values
	}
	_ = send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extproc.HttpHeaders{Headers: &corev3.HeaderMap{Headers: responseHeaders}}}})
	w.Header().Set(pickedHeader, destination)
	w.WriteHeader(response.StatusCode)
	flusher, _ := w.(http.Flusher)
	buffer := make([]byte, 32<<10)
	for {
		n, readErr := response.Body.Read(buffer)
		if n > 0 {
			chunk := append([]byte(nil), buffer[:n]...)
			if _, err := w.Write(chunk); err != nil {
				return // the client left: the pod sees the connection close
			}
			if flusher != nil {
				flusher.Flush()
			}
			_ = send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{
				ResponseBody: &extproc.HttpBody{Body: chunk}}})
		}
		if readErr != nil {
			_ = send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{
				ResponseBody: &extproc.HttpBody{EndOfStream: true}}})
			return
		}
	}
}

var errAnswered = errors.New("the picker answered the client itself")

// pick reads the picker's answers to the request: the destination and header mutations from the headers'
// answer, and the (possibly rewritten) body from the body's, streamed back in chunks. An immediate response
// (no endpoint, a rejected request) is passed to the client as it is.
func pick(stream extproc.ExternalProcessor_ProcessClient, w http.ResponseWriter) (string, map[string]string, []byte, error) {
	set := map[string]string{}
	var body []byte
	streamed := false
	for {
		answer, err := stream.Recv()
		if err != nil {
			return "", nil, nil, fmt.Errorf("receiving: %w", err)
		}
		switch a := answer.Response.(type) {
		case *extproc.ProcessingResponse_RequestHeaders:
			for _, header := range a.RequestHeaders.GetResponse().GetHeaderMutation().GetSetHeaders() {
				value := string(header.GetHeader().GetRawValue())
				if value == "" {
					value = header.GetHeader().GetValue()
				}
				set[strings.ToLower(header.GetHeader().GetKey())] = value
			}
		case *extproc.ProcessingResponse_RequestBody:
			mutation := a.RequestBody.GetResponse().GetBodyMutation()
			if s := mutation.GetStreamedResponse(); s != nil {
				streamed = true
				body = append(body, s.GetBody()...)
				if s.GetEndOfStream() {
					return set[destinationHeader], set, body, nil
				}
			} else {
				if b := mutation.GetBody(); b != nil {
					body = b
				}
				if !streamed {
					return set[destinationHeader], set, body, nil
				}
			}
		case *extproc.ProcessingResponse_ImmediateResponse:
			immediate := a.ImmediateResponse
			for _, header := range immediate.GetHeaders().GetSetHeaders() {
				w.Header().Set(header.GetHeader().GetKey(), string(header.GetHeader().GetRawValue()))
			}
			code := int(immediate.GetStatus().GetCode())
			if code == 0 {
				code = http.StatusServiceUnavailable
			}
			w.WriteHeader(code)
			_, _ = w.Write(immediate.GetBody())
			return "", nil, nil, errAnswered
		}
	}
}
