#include "router/zmq_socket.h"

#include <zmq.h>

namespace ferry::router {

void BoundZmqSocket(void* socket, int64_t max_message_bytes) {
    int linger = 0;
    zmq_setsockopt(socket, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(socket, ZMQ_MAXMSGSIZE, &max_message_bytes, sizeof max_message_bytes);
}

std::vector<std::string> ReceiveZmqFrames(void* socket, size_t max) {
    std::vector<std::string> frames;
    for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, socket, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&msg);
            return frames;
        }
        if (frames.size() < max) {
            frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
        }
        const bool more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
        if (!more) return frames;
    }
}

}  // namespace ferry::router
