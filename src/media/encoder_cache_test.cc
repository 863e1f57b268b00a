#include "media/encoder_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include "media/embeddings_file.h"

namespace ferry::media {
namespace {

Embeddings Floats(size_t n, float v) { return std::make_shared<std::vector<float>>(n, v); }

TEST(EncoderCache, KeepsTheMostRecentlyUsedUnderItsCapacity) {
    EncoderCache c(3 * 400);  // three entries of 100 floats
    c.Insert("a", Floats(100, 1));
    c.Insert("b", Floats(100, 2));
    c.Insert("c", Floats(100, 3));
    Embeddings held = c.Find("b");
    ASSERT_NE(c.Find("c"), nullptr);
    ASSERT_NE(c.Find("a"), nullptr);  // b is now the least recently used: it goes first
    c.Insert("d", Floats(100, 4));
    EXPECT_EQ(c.Find("b"), nullptr);
    EXPECT_EQ(held->at(0), 2);  // still valid for its holder
    EXPECT_EQ(c.Find("a")->at(0), 1);
    EXPECT_EQ(c.Find("d")->at(0), 4);
    c.Insert("d", Floats(100, 9));  // an entry there stays
    EXPECT_EQ(c.Find("d")->at(0), 4);
    c.Insert("huge", Floats(1000, 5));  // over the capacity: not kept, nothing evicted
    EXPECT_EQ(c.Find("huge"), nullptr);
    EncoderCacheStats s = c.Stats();
    EXPECT_EQ(s.entries, 3u);
    EXPECT_EQ(s.bytes, 1200u);
    EXPECT_EQ(s.evictions, 1u);
    EXPECT_EQ(s.inserts, 4u);
    EXPECT_EQ(s.hits, 6u);
    EXPECT_EQ(s.misses, 2u);
    EXPECT_EQ(s.capacity_bytes, 1200u);

    EncoderCache none(0);
    none.Insert("a", Floats(1, 1));
    EXPECT_EQ(none.Find("a"), nullptr);
}

// --- the disk tier ------------------------------------------------------------------------------

constexpr size_t kWidth = 4, kFloats = 100;  // 25 rows of 4
constexpr uint64_t kEntry = kFloats * sizeof(float);

std::string Hash(char c) { return std::string(64, c); }

class EncoderCacheDiskTest : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/ferry-ec-disk-XXXXXX";
        ASSERT_NE(mkdtemp(tmpl), nullptr);
        root_ = tmpl;
        dir_ = root_ + "/cache";  // made by Open
    }
    void TearDown() override { ASSERT_EQ(std::system(("rm -rf " + root_).c_str()), 0); }

    // The cache on `dir` (the test's directory if empty), with entries of kFloats floats.
    Result<std::unique_ptr<EncoderCache>> TryOpen(uint64_t memory, uint64_t disk,
                                                  std::string encoder = "enc-1",
                                                  std::string dir = "") {
        return EncoderCache::Open(memory, {.dir = dir.empty() ? dir_ : dir,
                                           .capacity_bytes = disk,
                                           .encoder = std::move(encoder),
                                           .entry_floats = kFloats,
                                           .width = kWidth});
    }
    std::unique_ptr<EncoderCache> Open(uint64_t memory, uint64_t disk,
                                       std::string encoder = "enc-1") {
        auto c = TryOpen(memory, disk, std::move(encoder));
        EXPECT_TRUE(c.ok()) << c.status().ToString();
        return c.ok() ? std::move(c).value() : nullptr;
    }
    std::string PathOf(char c) const { return dir_ + "/" + Hash(c) + ".safetensors"; }
    std::vector<std::string> Files() const {
        std::vector<std::string> out;
        DIR* d = opendir(dir_.c_str());
        while (dirent* e = d ? readdir(d) : nullptr) {
            if (e->d_name[0] != '.') out.push_back(e->d_name);
        }
        if (d) closedir(d);
        std::sort(out.begin(), out.end());
        return out;
    }

    std::string root_, dir_;
};

TEST_F(EncoderCacheDiskTest, EntriesEvictedFromMemoryAreFoundOnDisk) {
    auto c = Open(2 * kEntry, 100 * kEntry);
    ASSERT_NE(c, nullptr);
    c->Insert(Hash('a'), Floats(kFloats, 1));
    c->Insert(Hash('b'), Floats(kFloats, 2));
    EXPECT_TRUE(Files().empty());              // nothing evicted yet
    c->Insert(Hash('c'), Floats(kFloats, 3));  // a goes to disk
    EXPECT_EQ(Files(), std::vector<std::string>{Hash('a') + ".safetensors"});
    struct stat st {};
    ASSERT_EQ(stat(PathOf('a').c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);  // derived from users' images: the worker's alone

    Embeddings a = c->Find(Hash('a'));  // from disk, and in memory again (b goes to disk)
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(*a, std::vector<float>(kFloats, 1));
    EXPECT_EQ(c->Find(Hash('a')), a);        // a memory hit now: the same entry
    ASSERT_NE(c->Find(Hash('b')), nullptr);  // from disk
    EXPECT_EQ(c->Find(Hash('z')), nullptr);
    const EncoderCacheStats s = c->Stats();
    EXPECT_EQ(s.hits, 1u);
    EXPECT_EQ(s.disk_hits, 2u);
    EXPECT_EQ(s.misses, 1u);
    EXPECT_EQ(s.entries, 2u);
    EXPECT_EQ(s.bytes, 2 * kEntry);
    // a, b and c each went to disk once (a file already there is not written again).
    EXPECT_EQ(s.disk_writes, 3u);
    EXPECT_EQ(s.disk_entries, 3u);
    EXPECT_EQ(s.disk_bytes, 3 * uint64_t(st.st_size));
    EXPECT_GT(uint64_t(st.st_size), kEntry);  // the data and a header
    EXPECT_EQ(s.disk_capacity_bytes, 100 * kEntry);
    EXPECT_EQ(s.disk_write_errors + s.disk_bad_files + s.disk_evictions, 0u);

    // The file is the disk connector's format: vLLM's safetensors tensor, with ferry's keys.
    FileMetadata meta;
    auto r = ReadEmbeddingsFile(PathOf('a'), kFloats, kWidth, &meta);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(meta["mm_hash"], Hash('a'));
    EXPECT_EQ(meta["encoder"], "enc-1");
    EXPECT_EQ(meta["xxh3"].size(), 16u);
}

TEST_F(EncoderCacheDiskTest, TheFilesOutliveTheProcessForTheSameEncoderOnly) {
    {
        auto c = Open(0, 100 * kEntry);  // memory 0: every entry goes straight to disk
        ASSERT_NE(c, nullptr);
        c->Insert(Hash('a'), Floats(kFloats, 1));
        c->Insert(Hash('b'), Floats(kFloats, 2));
        EXPECT_EQ(c->Stats().entries, 0u);
        EXPECT_EQ(c->Find(Hash('a'))->at(0), 1);
        EXPECT_EQ(Files().size(), 2u);
        // One worker a directory: a second cache on it is refused, naming it.
        auto second = TryOpen(kEntry, kEntry);
        ASSERT_FALSE(second.ok());
        EXPECT_NE(second.status().message().find(dir_), std::string::npos);
        EXPECT_NE(second.status().message().find("another process"), std::string::npos);
    }
    {
        // A restart: a torn write's temporary file goes; the entries are found.
        std::ofstream(dir_ + "/.tmp-1-torn") << "half";
        std::ofstream(dir_ + "/notes.txt") << "not ours";  // left alone
        auto c = Open(10 * kEntry, 100 * kEntry);
        ASSERT_NE(c, nullptr);
        EXPECT_EQ(c->Stats().disk_entries, 2u);
        EXPECT_EQ(access((dir_ + "/.tmp-1-torn").c_str(), F_OK), -1);
        EXPECT_EQ(access((dir_ + "/notes.txt").c_str(), F_OK), 0);
        Embeddings b = c->Find(Hash('b'));
        ASSERT_NE(b, nullptr);
        EXPECT_EQ(*b, std::vector<float>(kFloats, 2));
    }
    {
        // Another vision encoder: its embeddings differ; the files are stale, removed as met.
        auto c = Open(10 * kEntry, 100 * kEntry, "enc-2");
        ASSERT_NE(c, nullptr);
        EXPECT_EQ(c->Find(Hash('a')), nullptr);
        EncoderCacheStats s = c->Stats();
        EXPECT_EQ(s.disk_bad_files, 1u);
        EXPECT_EQ(s.misses, 1u);
        EXPECT_EQ(s.disk_entries, 1u);
        EXPECT_EQ(access(PathOf('a').c_str(), F_OK), -1);
    }
}

TEST_F(EncoderCacheDiskTest, TheDiskCapacityRemovesTheLeastRecentlyUsedFiles) {
    auto c = Open(0, 3 * kEntry + 3 * 400);  // three files (data + header) and no more
    ASSERT_NE(c, nullptr);
    for (char h : std::string("abc")) c->Insert(Hash(h), Floats(kFloats, float(h)));
    ASSERT_NE(c->Find(Hash('a')), nullptr);  // a is used: b is now the oldest
    c->Insert(Hash('d'), Floats(kFloats, 4));
    EncoderCacheStats s = c->Stats();
    EXPECT_EQ(s.disk_entries, 3u);
    EXPECT_EQ(s.disk_evictions, 1u);
    EXPECT_LE(s.disk_bytes, s.disk_capacity_bytes);
    EXPECT_EQ(c->Find(Hash('b')), nullptr);
    EXPECT_EQ(access(PathOf('b').c_str(), F_OK), -1);
    EXPECT_NE(c->Find(Hash('a')), nullptr);
    EXPECT_NE(c->Find(Hash('d')), nullptr);
    // A restart over a smaller capacity removes the oldest files until it fits.
    c.reset();
    c = Open(0, kEntry + 400);
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->Stats().disk_entries, 1u);
    EXPECT_EQ(Files().size(), 1u);
}

TEST_F(EncoderCacheDiskTest, AFileThatFailsACheckIsAMissAndGoes) {
    auto c = Open(0, 100 * kEntry);
    ASSERT_NE(c, nullptr);
    for (char h : std::string("abcdef")) c->Insert(Hash(h), Floats(kFloats, float(h)));
    ASSERT_EQ(Files().size(), 6u);
    auto slurp = [&](char h) {
        std::ifstream in(PathOf(h), std::ios::binary);
        return std::string(std::istreambuf_iterator<char>(in), {});
    };
    auto put = [&](char h, const std::string& bytes) {
        std::ofstream(PathOf(h), std::ios::binary | std::ios::trunc) << bytes;
    };
    std::string a = slurp('a');
    a[a.size() - 5] ^= 0x40;  // one bit of the data: its checksum fails
    put('a', a);
    put('b', slurp('b').substr(0, 300));  // torn
    put('c', slurp('d'));                 // d's file under c's name: another image
    put('d', "");                         // empty
    std::string e = slurp('e');
    e.replace(e.find("[25,4]"), 6, "[50,2]");  // another shape
    put('e', e);
    for (char h : std::string("abcde")) {
        EXPECT_EQ(c->Find(Hash(h)), nullptr) << h;
        EXPECT_EQ(access(PathOf(h).c_str(), F_OK), -1) << h;
    }
    EXPECT_EQ(*c->Find(Hash('f')), std::vector<float>(kFloats, float('f')));
    const EncoderCacheStats s = c->Stats();
    EXPECT_EQ(s.disk_bad_files, 5u);
    EXPECT_EQ(s.misses, 5u);
    EXPECT_EQ(s.disk_hits, 1u);
    EXPECT_EQ(s.disk_entries, 1u);
    // An entry the cache cannot write is lost, not fatal: the directory is gone.
    ASSERT_EQ(std::system(("rm -rf " + dir_).c_str()), 0);
    c->Insert(Hash('g'), Floats(kFloats, 7));
    EXPECT_EQ(c->Stats().disk_write_errors, 1u);
    EXPECT_EQ(c->Find(Hash('g')), nullptr);
}

TEST_F(EncoderCacheDiskTest, BadDirectoriesAreRefusedByName) {
    std::ofstream(root_ + "/file") << "x";
    auto not_dir = TryOpen(kEntry, kEntry, "e", root_ + "/file");
    ASSERT_FALSE(not_dir.ok());
    EXPECT_NE(not_dir.status().message().find(root_ + "/file"), std::string::npos);
    auto no_parent = TryOpen(kEntry, kEntry, "e", root_ + "/no/such");
    ASSERT_FALSE(no_parent.ok());
    EXPECT_NE(no_parent.status().message().find("mkdir"), std::string::npos);
    // Others may write there: what it reads back could be planted.
    ASSERT_EQ(mkdir((root_ + "/open").c_str(), 0777), 0);
    ASSERT_EQ(chmod((root_ + "/open").c_str(), 0777), 0);
    auto open_dir = TryOpen(kEntry, kEntry, "e", root_ + "/open");
    ASSERT_FALSE(open_dir.ok());
    EXPECT_NE(open_dir.status().message().find("other users may write"), std::string::npos);
}

TEST_F(EncoderCacheDiskTest, ManyThreadsFindAndInsertTogether) {
    auto c = Open(4 * kEntry, 16 * kEntry + 16 * 400);
    ASSERT_NE(c, nullptr);
    std::vector<std::thread> threads;
    std::atomic<int> wrong{0};
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
            for (int i = 0; i < 200; ++i) {
                const int k = (i * 7 + t * 3) % 24;
                const std::string h =
                    std::string(62, 'a') + char('a' + k / 16) + "0123456789abcdef"[k % 16];
                if (Embeddings e = c->Find(h)) {
                    if (*e != std::vector<float>(kFloats, float(k))) ++wrong;
                } else {
                    c->Insert(h, Floats(kFloats, float(k)));
                }
            }
        });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(wrong.load(), 0);
    const EncoderCacheStats s = c->Stats();
    EXPECT_LE(s.bytes, s.capacity_bytes);
    EXPECT_LE(s.disk_bytes, s.disk_capacity_bytes);
    EXPECT_GT(s.disk_hits, 0u);
    EXPECT_EQ(s.disk_bad_files + s.disk_write_errors, 0u);
}

// Found by embeddings_file_fuzzer: a header field of another type (here "dtype" an array) threw
// out of the parser (nlohmann's value()), which would have ended the worker reading a shared
// directory's file. Every such file is a DataLoss naming the file.
TEST(EmbeddingsFile, HeaderFieldsOfAnotherTypeAreRefusedNotThrown) {
    auto file = [](const std::string& header) {
        std::string out(8, '\0');
        const uint64_t n = header.size();
        std::memcpy(out.data(), &n, 8);
        return out + header + std::string(48, '\0');
    };
    for (
        const std::string h :
        {R"({"ec_cache":{"dtype":[3,4],"shape":[3,4],"data_offsets":[0,48]}})",
         R"({"ec_cache":{"dtype":"F32","shape":"3x4","data_offsets":[0,48]}})",
         R"({"ec_cache":{"dtype":"F32","shape":[3,4],"data_offsets":{"a":1}}})",
         R"({"ec_cache":[1,2]})",
         R"({"__metadata__":{"xxh3":7},"ec_cache":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]}})",
         R"({"__metadata__":[],"ec_cache":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]}})",
         R"([1,2,3])", R"({"ec_cache":)"}) {
        auto r = ParseEmbeddingsFile(file(h), "f.safetensors", 12, 4);
        ASSERT_FALSE(r.ok()) << h;
        EXPECT_EQ(r.status().code(), Code::kDataLoss) << h;
        EXPECT_NE(r.status().message().find("f.safetensors"), std::string::npos) << h;
    }
    // The same file well formed (vLLM's: no metadata) is read.
    auto ok = ParseEmbeddingsFile(
        file(R"({"ec_cache":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]}})"), "f", 12, 4);
    ASSERT_TRUE(ok.ok()) << ok.status().ToString();
    EXPECT_EQ(**ok, std::vector<float>(12, 0.0f));
}

// A file far larger than the tensor it should hold (a shared directory holds what other hosts
// put there) is refused from its size, before any of it is read into memory.
TEST(EmbeddingsFile, AFileLargerThanItsTensorIsRefusedBeforeItIsRead) {
    char tmpl[] = "/tmp/ferry-ef-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    const std::string path = std::string(tmpl) + "/huge.safetensors";
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, off_t(3) << 30), 0);  // 3 GiB, sparse
    close(fd);
    auto r = ReadEmbeddingsFile(path, 12, 4);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kDataLoss);
    EXPECT_NE(r.status().message().find("at most"), std::string::npos) << r.status().message();
    // One written by the writer is within the bound, and its size is what the writer said.
    const std::string ok_path = std::string(tmpl) + "/ok.safetensors";
    auto written = WriteEmbeddingsFile(ok_path, std::vector<float>(12, 1.5f), 4, {});
    ASSERT_TRUE(written.ok()) << written.status().ToString();
    struct stat st {};
    ASSERT_EQ(stat(ok_path.c_str(), &st), 0);
    EXPECT_EQ(*written, uint64_t(st.st_size));
    EXPECT_TRUE(ReadEmbeddingsFile(ok_path, 12, 4).ok());
    ASSERT_EQ(std::system(("rm -rf " + std::string(tmpl)).c_str()), 0);
}

}  // namespace
}  // namespace ferry::media
