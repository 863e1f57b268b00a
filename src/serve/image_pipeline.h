// The images of chat requests, from a parsed request to its embeddings in place: each
// image_url part read (data: or file:// URL) and decoded off the I/O threads, its embeddings
// found in the encoder cache by mm_hash, loaded through the encoder-cache connector (EPD), asked
// of an encode worker (--encoder-urls) or computed by the vision encoder, placed at its
// placeholder tokens (engine::MmInput). A bad image is a 400 naming its part; memory stays
// bounded: one image is decoded at a time, and the queue of requests waiting for it is capped
// (503 beyond). On an encode worker the embeddings are published and the answer says where.
// Part of OpenAiServer (openai_server_parts.h).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "http/http.h"
#include "media/encoder_cache.h"
#include "router/worker_call.h"
#include "serve/openai_request.h"
#include "serve/openai_server.h"
#include "tokenizer/prompt.h"

namespace ferry::serve {

// Requests with images wait here for their decoding and encoding, off the I/O threads: one
// thread (the encoder runs one image at a time), a bounded queue.
class MediaQueue {
  public:
    explicit MediaQueue(size_t capacity) : capacity_(capacity) {}
    ~MediaQueue() { Stop(); }
    // False if the queue is full or stopped (the job is not run).
    bool Post(std::function<void()> job) {
        std::lock_guard lock(mu_);
        if (stopped_ || jobs_.size() >= capacity_) return false;
        jobs_.push_back(std::move(job));
        if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
        cv_.notify_one();
        return true;
    }
    // Runs what was queued, then joins the thread; later posts are refused.
    void Stop() {
        {
            std::lock_guard lock(mu_);
            stopped_ = true;
            cv_.notify_one();
        }
        if (thread_.joinable()) thread_.join();
    }
    size_t Waiting() {
        std::lock_guard lock(mu_);
        return jobs_.size();
    }

  private:
    void Run() {
        std::unique_lock lock(mu_);
        for (;;) {
            cv_.wait(lock, [&] { return stopped_ || !jobs_.empty(); });
            if (jobs_.empty()) return;
            std::function<void()> job = std::move(jobs_.front());
            jobs_.pop_front();
            lock.unlock();
            job();
            lock.lock();
        }
    }
    const size_t capacity_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::function<void()>> jobs_;
    bool stopped_ = false;
    std::thread thread_;
};

// What the image path counts (/metrics).
// EPD consumer: while a request that will load an encode worker's entries waits in the media
// queue, their leases are renewed (EcConnector::Renew) on arrival and each interval, for three
// intervals each time: a long queue keeps them, and a consumer that dies lets them go within
// three intervals instead of the producer's whole lease.
class EcRenewals {
  public:
    EcRenewals(std::shared_ptr<EcConnector> ec, std::chrono::milliseconds every)
        : ec_(std::move(ec)), every_(every) {}
    ~EcRenewals();
    // A request that waits: renewed now, then each interval until Done(the id returned).
    uint64_t Waiting(std::shared_ptr<const EcSource> source);
    void Done(uint64_t id);

  private:
    void Run();
    const std::shared_ptr<EcConnector> ec_;
    const std::chrono::milliseconds every_;
    std::mutex mu_;
    std::condition_variable cv_;
    struct Entry {
        std::shared_ptr<const EcSource> source;
        std::chrono::steady_clock::time_point next;
    };
    std::map<uint64_t, Entry> waiting_;
    uint64_t next_id_ = 1;
    bool stop_ = false;
    std::thread thread_;
};

struct ImageMetrics {
    std::atomic<uint64_t> images{0};         // decoded
    std::atomic<uint64_t> encoded{0};        // run through the encoder
    std::atomic<uint64_t> refused{0};        // requests refused for an image
    std::atomic<uint64_t> busy{0};           // requests refused: the queue was full
    std::atomic<uint64_t> encode_micros{0};  // in the encoder
    std::atomic<uint64_t> decode_micros{0};  // reading and decoding
    std::atomic<uint64_t> ec_fallbacks{0};   // encoded here: the ec connector could not load
    std::atomic<uint64_t> encoder_calls{0};  // --encoder-urls: requests an encode worker took
    std::atomic<uint64_t> encoder_call_failures{0};  // ... that failed there
    std::atomic<uint64_t> dropped{0};  // requests whose client left before their images were done
};

class ImagePipeline {
  public:
    // For a server with a vision encoder: checks it fits the model, opens the encoder cache and
    // the queue. The server's HTTP client and quarantine must be made (--encoder-urls calls).
    static Result<std::unique_ptr<ImagePipeline>> Create(OpenAiServer::Impl& server);

    // Reads, decodes and encodes a parsed request's images (asking an encode worker first with
    // --encoder-urls) on the media queue, then routes it; a bad image gets a 400 naming its
    // part.
    void Serve(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr);
    // The embeddings of pr->images into pr->mm: from the encoder cache, the ec connector or the
    // encoder; an encode worker publishes them through its connector. An error names the
    // image's part (InvalidArgument: a bad image; otherwise the connector's). Cancelled, with
    // nothing more done, once `ex` (if given) has closed: the client left.
    Status Encode(ParsedRequest* pr, BadRequest* bad, const http::Exchange* ex = nullptr);
    // Requests waiting for the encoder run; later ones get 503.
    void StopQueue() { queue_->Stop(); }

    // The placeholder tokens an image takes (what request parsing needs).
    const tokenizer::ImageTokens* tokens() const { return &tokens_; }
    const ImageMetrics& metrics() const { return metrics_; }
    media::EncoderCache& cache() { return *cache_; }
    size_t waiting() { return queue_->Waiting(); }

  private:
    explicit ImagePipeline(OpenAiServer::Impl& server) : m_(server) {}
    // --encoder-urls: asks one of `encoders` to publish the request's images, then Enqueue with
    // where they are (or, if it failed, without: they are encoded here).
    void CallEncoder(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                     const std::string& rid, const std::vector<http::Endpoint>& encoders);
    // Queues the request for the media thread (503 when the queue is full).
    void Enqueue(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                 const std::string& rid);
    // The encode role's answer: a chat.completion with no tokens and the ec_transfer_params
    // that say where the embeddings wait.
    void ReplyEncoded(const std::shared_ptr<http::Exchange>& ex, const ParsedRequest& pr,
                      const std::string& rid);

    OpenAiServer::Impl& m_;
    tokenizer::ImageTokens tokens_;
    std::unique_ptr<media::EncoderCache> cache_;
    // EPD consumer: the leases of queued requests' entries (null: not a consumer). Before the
    // queue: the queue's jobs (run as it stops) end their renewals.
    std::unique_ptr<EcRenewals> renewals_;
    std::unique_ptr<MediaQueue> queue_;
    ImageMetrics metrics_;
    // --encoder-urls: the encode step, as the router runs it.
    std::unique_ptr<router::EncodeStep> encode_step_;
};

}  // namespace ferry::serve
