// The gateway's side of an Inference Extension ext_proc exchange, for the InferencePool e2e test: no
// gateway binary (Envoy, agentgateway, NGINX Gateway Fabric) can be had on the test machines.
module tally.dev/tests/gateway

go 1.25.0

require (
	github.com/envoyproxy/go-control-plane/envoy v1.37.0
	golang.org/x/net v0.49.0
	google.golang.org/grpc v1.80.0
)

require (
	github.com/cncf/xds/go v0.0.0-20251210132809-ee656c7534f5 // indirect
	github.com/envoyproxy/protoc-gen-validate v1.3.0 // indirect
	github.com/planetscale/vtprotobuf v0.6.1-0.20240319094008-0393e58bdf10 // indirect
	golang.org/x/sys v0.40.0 // indirect
	golang.org/x/text v0.33.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260120221211-b8f7ae30c516 // indirect
	google.golang.org/protobuf v1.36.11 // indirect
)
