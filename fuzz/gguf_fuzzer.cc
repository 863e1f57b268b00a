// GGUF files: the header, metadata and tensor table, then the model config and tokenizer built
// from whatever parsed.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "gguf/gguf.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    int fd = memfd_create("gguf", MFD_CLOEXEC);
    if (fd < 0) return 0;
    if (size > 0 && write(fd, data, size) != static_cast<ssize_t>(size)) {
        close(fd);
        return 0;
    }
    auto file = ferry::gguf::GgufFile::Open("/proc/self/fd/" + std::to_string(fd));
    if (file.ok()) {
        (void)ferry::model::ModelConfig::FromGguf(**file);
        auto tk = ferry::tokenizer::Tokenizer::FromGguf(**file);
        if (tk.ok()) {
            auto ids = (*tk)->Encode("Hello, world! <|im_start|> 123", true);
            (void)(*tk)->Decode(ids);
        }
    }
    close(fd);
    return 0;
}
