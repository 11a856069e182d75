"""Agents and proxy managers: the gateway's gRPC channel (agent.proto) and both of its ends.

* ``registry`` -- which agents are connected to this node, the streams they carry, and the
  ``AgentDialer`` through which the session pipeline reaches a connection whose ``agent_id`` is set;
* ``server`` -- the gateway's gRPC server (``[grpc] listen``, TLS): agents' control channels and
  tunnels, proxy managers' channels;
* ``runner`` -- ``gatewayd agent``: the process inside a private network that connects out;
* ``manager`` -- ``gatewayd proxy-manager``: the process on a user's machine that opens local ports;
* ``tunnel`` -- the tunnel listener beside the gRPC server: each stream on a TLS connection of its own;
* ``pump`` -- the bytes of one stream between a socket and a gRPC call or a tunnel connection, both ways,
  with back-pressure.
"""
